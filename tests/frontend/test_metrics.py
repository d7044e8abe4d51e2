from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from frontend.metrics import METRICS_CONTENT_TYPE, Metrics


def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }


def test_each_instance_owns_its_registry() -> None:
    first, second = Metrics(), Metrics()
    first.requests.labels(role="generation", endpoint="chat", status="200").inc()
    key = ("disagg_requests_total", (("endpoint", "chat"), ("role", "generation"), ("status", "200")))
    assert samples(first)[key] == 1
    assert key not in samples(second)


def test_rendered_text_is_prometheus_exposition() -> None:
    metrics = Metrics()
    metrics.gen_prompt_path.labels(path="array").inc(3)
    metrics.engine_inflight.labels(role="context").inc()
    metrics.time_to_first_token.observe(0.02)
    metrics.request_latency.labels(endpoint="responses").observe(0.3)
    got = samples(metrics)
    assert got[("disagg_gen_prompt_path_total", (("path", "array"),))] == 3
    assert got[("disagg_engine_inflight_requests", (("role", "context"),))] == 1
    assert got[("disagg_time_to_first_token_seconds_count", ())] == 1
    assert got[("disagg_time_to_first_token_seconds_bucket", (("le", "0.025"),))] == 1
    assert got[("disagg_time_to_first_token_seconds_bucket", (("le", "0.01"),))] == 0
    assert got[("disagg_request_latency_seconds_sum", (("endpoint", "responses"),))] == 0.3
    assert METRICS_CONTENT_TYPE.startswith("text/plain")
