"""The hand-off ledger of an engine without a store (the synthetic engine): exported at 0 from start-up by a CTX, and
counted by the workers as they see hand-offs (parked by CTX, taken by GEN, released at the orchestrator's word),
so that the dashboard's ledger panel of a synthetic system shows the truth rather than "No data"."""

from __future__ import annotations

import contextlib

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster import MODEL, start_orchestrator, start_worker
from workers.engines.base import HANDOFF_TOTALS


def ledger(url: str) -> dict[str, float]:
    """``disagg_kv_handoffs_total`` by outcome, as scraped."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {s.labels["outcome"]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "disagg_kv_handoffs_total"}


def test_a_synthetic_ctx_exports_its_ledger_at_zero_and_the_workers_count_each_hand_off() -> None:
    with contextlib.ExitStack() as stack:
        ctx, gen = start_worker(stack, "context"), start_worker(stack, "generation")
        assert ledger(ctx.url) == dict.fromkeys(HANDOFF_TOTALS, 0.0)
        orchestrator = start_orchestrator(stack, [ctx.url], [gen.url])
        client = openai.OpenAI(base_url=orchestrator.url + "/v1", api_key="x", max_retries=0, timeout=60)
        assert client.completions.create(model=MODEL, prompt="hello", max_tokens=8).choices[0].text
        assert list(client.completions.create(model=MODEL, prompt="hello", max_tokens=8, stream=True))
        # Parked on CTX, taken on GEN: summed over the two (as the dashboard sums), every hand-off is accounted for.
        assert ledger(ctx.url) == {"parked": 2.0, "taken": 0.0, "released": 0.0, "expired": 0.0}
        assert ledger(gen.url) == {"taken": 2.0}
        # The orchestrator releasing one that no GEN will take (its client left) counts on CTX.
        released = httpx.post(ctx.url + "/v1/disagg/release", timeout=10,
                              json={"ctx_request_id": "1", "encoded_opaque_state": "e30="})
        assert released.status_code == 200 and released.json() == {"released": False}  # nothing was held
        assert ledger(ctx.url)["released"] == 1.0
