"""bench.prompt_path's report: list vs array vs floor per prompt size (time, CPU, allocation per token), each stage
of GEN's parse, the pickle round trips; and the targets at 131,072 tokens."""

from __future__ import annotations

from typing import Any

from bench.driver.report import fmt, markdown_table

TARGET_SIZE = 131_072


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    at = next((s for s in result["sizes"] if s["tokens"] == TARGET_SIZE), None)
    if at is None:
        return []
    speedup, ratio = at["speedup_list_over_array"], at["array_over_floor"]
    per_token = at["allocation"]["array"]["peak_beyond_body_per_token"]
    return [
        {"target": "array path >= 12x cheaper than the list path at 131,072 tokens (aim 15x)",
         "measured": f"{speedup:.1f}x", "met": speedup >= 12, "aim_met": speedup >= 15},
        {"target": "array path within 2x of the floor at 131,072 tokens (aim 1.2x)",
         "measured": f"{ratio:.2f}x", "met": ratio <= 2, "aim_met": ratio <= 1.2},
        {"target": "array path peak allocation <= 3 bytes per prompt token beyond the body",
         "measured": f"{per_token:.2f} B/token (floor: "
                     f"{at['allocation']['floor']['peak_beyond_body_per_token']:.2f})",
         "met": per_token <= 3, "aim_met": per_token <= 3},
        {"target": "pickle round trips of GenerationRequest give identical token lists",
         "measured": ", ".join(f"{p}: {at['pickle'][p]['identical_tokens']}" for p in ("list", "array")),
         "met": all(at["pickle"][p]["identical_tokens"] for p in ("list", "array")), "aim_met": None},
    ]


def tables(result: dict[str, Any]) -> str:
    rows = []
    for s in result["sizes"]:
        t, a = s["timing"], s["allocation"]
        rows.append([
            f"{s['tokens']:,}",
            fmt(t["list"]["ms"], 3), fmt(t["array"]["ms"], 3), fmt(t["floor"]["ms"], 3),
            fmt(s["speedup_list_over_array"], 1) + "x", fmt(s["array_over_floor"]) + "x",
            fmt(a["list"]["peak_beyond_body_per_token"]), fmt(a["array"]["peak_beyond_body_per_token"]),
            fmt(a["floor"]["peak_beyond_body_per_token"]),
        ])
    main = markdown_table(
        ["prompt tokens", "list ms/op", "array ms/op", "floor ms/op", "list/array", "array/floor",
         "list B/tok", "array B/tok", "floor B/tok"], rows)
    extra_rows = []
    for s in result["sizes"]:
        t, a = s["timing"], s["allocation"]
        extra_rows.append([
            f"{s['tokens']:,}", f"{s['body_bytes']['list']:,}", f"{s['body_bytes']['array']:,}",
            fmt(t["list"]["cpu_ms"], 3), fmt(t["array"]["cpu_ms"], 3), fmt(t["floor"]["cpu_ms"], 3),
            fmt(a["list"]["peak_total_per_token"], 1), fmt(a["array"]["peak_total_per_token"], 1),
            fmt(a["floor"]["peak_total_per_token"], 1),
        ])
    extra = markdown_table(
        ["prompt tokens", "list body B", "array body B", "list CPU ms", "array CPU ms", "floor CPU ms",
         "list B/tok incl. parse", "array B/tok incl. parse", "floor B/tok incl. parse"], extra_rows)
    parts = [main, "", extra]
    if "stages_ms" in result["sizes"][0]:
        names = list(result["sizes"][0]["stages_ms"]["list"])
        stage_rows = []
        for s in result["sizes"]:
            for path in ("list", "array"):
                stage_rows.append([f"{s['tokens']:,}", path, *(fmt(s["stages_ms"][path][n], 3) for n in names)])
        parts += ["", markdown_table(["prompt tokens", "path", *(f"{n} ms" for n in names)], stage_rows)]
    pickle_rows = []
    for s in result["sizes"]:
        p = s["pickle"]
        pickle_rows.append([
            f"{s['tokens']:,}", str(p["list"]["identical_tokens"]), str(p["array"]["identical_tokens"]),
            fmt(p["array"]["pickled_bytes_per_token"]), str(p["array"]["array_path_built_list_when_pickled"]),
            fmt(p["array"]["round_trip_ms"], 3), fmt(p["plain_list_round_trip_ms"], 3),
        ])
    parts += ["", markdown_table(
        ["prompt tokens", "list path identical", "array path identical", "pickled B/tok",
         "unread request built a list", "GenerationRequest round trip ms", "plain list[int] round trip ms"],
        pickle_rows)]
    return "\n".join(parts)
