"""``--plot``: a PNG of the TTFT and inter-token-latency distributions (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def distributions_png(result: dict[str, Any], rows: list[dict[str, Any]], path: Path, title: str) -> Path:
    try:
        import matplotlib
    except ImportError as exc:
        raise SystemExit("disagg-serve bench --plot needs matplotlib: pip install matplotlib") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ttft = [r["ttft_ms"] for r in rows if r["ttft_ms"] is not None]
    itl = [gap for r in rows if r["ok"] for gap in r["itl_ms"]]
    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    for axis, values, label, key in ((axes[0], ttft, "time to first token (ms)", "ttft_ms"),
                                     (axes[1], itl, "inter-token latency (ms)", "itl_ms")):
        if values:
            axis.hist(values, bins=min(50, max(5, len(values) // 4)), color="#1f77b4", alpha=0.8)
            for q, style in (("p50", "-"), ("p90", "--"), ("p99", ":")):
                value = result[key][q]
                axis.axvline(value, color="#d62728", linestyle=style, label=f"{q} {value:,.1f} ms")
            axis.legend(fontsize=8)
        axis.set_xlabel(label)
        axis.set_ylabel("count")
        axis.grid(alpha=0.3)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
