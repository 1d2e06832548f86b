"""The metrics an endpoint picker scrapes: vLLM's names, each equal to `/v1/admission`'s numbers, and the
estimated wait of a median-size request.

The engine is stepped by hand (its loop is not started), so `/metrics` and `/v1/admission` read the
same state and every value can be compared exactly.
"""

from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from helexa.admission.rates import EngineRates
from helexa.engine.engine import Engine
from helexa.model.sampling import SamplingParams
from helexa.server.app import create_app
from helexa.server.metrics import METRIC_NAMES, VLLM_METRIC_NAMES
from tests.support.engines import cpu_config

BS = 4


def _scrape(client: TestClient) -> tuple[dict[tuple[str, tuple], float], dict]:
    text = client.get("/metrics").text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    return samples, client.get("/v1/admission").json()


def _value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


@pytest.fixture()
def engine(tiny_model_dir):
    config = cpu_config(
        tiny_model_dir, num_blocks=32, block_size=BS, max_num_batched_tokens=64, max_num_seqs=2,
        kv_events_endpoint="tcp://127.0.0.1:*", replan_interval_secs=0.0,
    )  # fmt: skip
    engine = Engine(config)
    yield engine
    engine.shutdown()


def test_vllm_names_equal_the_admission_snapshot(engine: Engine) -> None:
    client = TestClient(create_app(engine))
    model = {"model_name": engine.model_name}
    samples, snap = _scrape(client)
    assert _value(samples, "helexa_admission_estimated_wait_seconds") == 0.0  # idle: a request would start at once
    new = ("helexa_admission_estimated_wait_seconds", "helexa_kv_event_batches_published_total",
           "helexa_kv_event_batches_dropped_total")  # fmt: skip
    assert set(new) <= set(METRIC_NAMES)
    for name in (*new, *VLLM_METRIC_NAMES):
        assert any(key[0] == name for key in samples), name

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    handles = [engine.submit([3 + (i * 7 + j) % 300 for j in range(20)], params) for i in range(4)]  # 7 blocks each
    for _ in range(3):
        engine.step()
        engine.check_integrity()  # every in-use block is charged to one reservation (or orphaned, and reserved)
    samples, snap = _scrape(client)
    assert snap["in_flight"] == 2 and snap["queue_depth"] == 2 and snap["blocks_in_use"] > 0
    assert _value(samples, "vllm:num_requests_waiting", **model) == snap["queue_depth"]
    assert _value(samples, "vllm:num_requests_running", **model) == snap["in_flight"]
    usage = _value(samples, "vllm:kv_cache_usage_perc", **model)
    assert usage == snap["blocks_reserved"] / snap["blocks_total"] and 0 < usage <= 1
    assert usage >= snap["blocks_in_use"] / snap["blocks_total"]  # in use + reserved-not-yet-allocated
    info = dict(
        block_size=str(snap["block_size"]), num_gpu_blocks=str(snap["blocks_total"]), cache_dtype="auto",
        enable_prefix_caching="True",
    )  # fmt: skip
    assert _value(samples, "vllm:cache_config_info", **info) == 1.0
    lora = dict(max_lora="0", running_lora_adapters="", waiting_lora_adapters="")
    assert _value(samples, "vllm:lora_requests_info", **lora) > 0
    assert _value(samples, "helexa_kv_cache_usage_ratio") == usage
    for key, name in (("blocks_total", "helexa_kv_blocks_total"), ("blocks_reserved", "helexa_kv_blocks_reserved"),
                      ("blocks_in_use", "helexa_kv_blocks_in_use"), ("blocks_cached", "helexa_kv_blocks_cached"),
                      ("queue_depth", "helexa_queue_depth"), ("in_flight", "helexa_requests_in_flight")):  # fmt: skip
        assert _value(samples, name) == snap[key], name

    # The estimate is a time to come: it shrinks as the clock runs while nothing steps. Slow rates (replanned at
    # once: no replan interval) make it seconds long, and the clock around the two readings bounds their gap.
    engine.admission.set_rates(EngineRates(decode_step_seconds=2.0, prefill_token_seconds=0.01))
    assert engine.request_sizes.median() == (20, 8)
    before = time.monotonic()
    wait = _value(_scrape(client)[0], "helexa_admission_estimated_wait_seconds")
    direct = engine.admission.estimate_wait(20, 8)
    elapsed = time.monotonic() - before
    assert wait > 2.0  # two requests of that size already wait for the two running ones, a step at least
    assert 0.0 <= wait - direct <= elapsed, (wait, direct, elapsed)
    assert engine.kv_events is not None and engine.kv_events.publisher.flush(10.0)
    samples, _ = _scrape(client)
    assert _value(samples, "helexa_kv_event_batches_published_total") == engine.kv_events.published > 1
    assert _value(samples, "helexa_kv_event_batches_dropped_total") == 0
    for h in handles:
        engine.abort(h.request_id)
    engine.step()


def test_the_median_request_is_one_that_was_served() -> None:
    from helexa.admission.estimator import RequestSizes

    sizes = RequestSizes(window=3)
    asked: list[tuple[int, int]] = []

    def estimate(prompt: int, max_tokens: int) -> float:
        asked.append((prompt, max_tokens))
        return 1.5

    assert sizes.median_wait(estimate, (16, 16)) == 1.5 and asked == [(16, 16)]  # none seen: the default size
    for size in [(4000, 10), (10, 4000), (100, 100), (5, 5)]:  # the window keeps the last 3
        sizes.observe(*size)
    assert sizes.median() == (100, 100)  # totals 4010, 200, 10: never a mix like (100, 4000)
    sizes.median_wait(estimate, (16, 16))
    assert asked[-1] == (100, 100)
    with pytest.raises(ValueError):
        RequestSizes(window=0)
