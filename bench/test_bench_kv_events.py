"""KV events cost the engine step nothing measurable: the same workload, events off and on, in one run.

Two engines serve the tiny random model on CPU with a small pool, so every step stores blocks and
many evict (the worst case for the event stream: a batch per step); the step the benchmark times is
`Engine.step()` while a steady stream of prompts with shared prefixes runs, the two engines' steps
interleaved so they share the machine's load. The events-on median is printed beside the events-off
baseline, with the median time of the one call events add to a step (`end_step`). Run with `make bench` or
`pytest bench/test_bench_kv_events.py --benchmark-enable -s`.
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

import pytest

from helexa.config import EngineConfig
from helexa.engine.engine import Engine
from helexa.model.sampling import SamplingParams
from tests.support.models import build_tiny_tokenizer_dir, make_tiny_model

_results: dict[str, float] = {}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_tiny_model(
        tmp_path_factory.mktemp("bench_events"), "llama", vocab_size=512, max_position_embeddings=512
    )
    build_tiny_tokenizer_dir(path)
    return path


def _engine(model_dir: Path, events: bool) -> Engine:
    extra = (
        dict(kv_events_endpoint="tcp://127.0.0.1:*", kv_events_replay_endpoint="tcp://127.0.0.1:*") if events else {}
    )
    config = EngineConfig.of(
        model=str(model_dir), device="cpu", dtype="float32", attention_backend="torch", num_blocks=48, block_size=4,
        max_num_batched_tokens=64, max_num_seqs=4, max_wait_secs=600.0, target_step_secs=0.0, **extra,
    )  # fmt: skip
    return Engine(config)


def _stepper(engine: Engine):
    """A step function that keeps 4 requests with shared prefixes in flight (a new one as each ends)."""
    rng = random.Random(0)
    prefixes = [[rng.randrange(3, 400) for _ in range(n)] for n in (12, 20, 28)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    handles: list = []

    def step() -> None:
        handles[:] = [h for h in handles if not _ended(h)]
        while len(handles) < 4:
            prompt = rng.choice(prefixes) + [rng.randrange(3, 400) for _ in range(rng.randint(1, 12))]
            handles.append(engine.submit(prompt, params))
        engine.step()

    return step


def _ended(handle) -> bool:
    while (event := handle.stream.get(timeout=0)) is not None:
        if event.finished:
            return True
    return False


def test_step_time_events_on_vs_off(benchmark, model_dir: Path) -> None:
    """Steps of the two engines alternate (off, on, off, on, ...), so both see the same machine load."""
    off, on = _engine(model_dir, events=False), _engine(model_dir, events=True)
    assert on.kv_events is not None
    times: dict[str, list[float]] = {"off": [], "on": [], "end_step": []}
    end_step = on.kv_events.end_step

    def timed_end_step() -> None:
        t0 = time.perf_counter()
        end_step()
        times["end_step"].append(time.perf_counter() - t0)

    on.kv_events.end_step = timed_end_step  # type: ignore[method-assign]
    try:
        step_off, step_on = _stepper(off), _stepper(on)
        for _ in range(20):  # warm: the caches fill and start evicting
            step_off()
            step_on()
        times["end_step"].clear()
        before = on.kv_events.published

        def pair() -> None:
            for name, step in (("off", step_off), ("on", step_on)):
                t0 = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - t0)

        benchmark.pedantic(pair, rounds=150 if getattr(benchmark, "enabled", False) else 3, iterations=1)
        assert on.kv_events.publisher.flush(10.0) and on.kv_events.dropped == 0
        assert on.counters.prefix_cache_evictions > 0 and on.kv_events.published > before
        m_off, m_on = statistics.median(times["off"]), statistics.median(times["on"])
        m_end = statistics.median(times["end_step"])
        print(
            f"\nengine step median: events on {m_on * 1e3:.2f} ms, events off (baseline) {m_off * 1e3:.2f} ms, "
            f"x{m_on / m_off:.3f}; end_step median {m_end * 1e6:.1f} us ({m_end / m_on:.2%} of a step); "
            f"{on.kv_events.published - before} batches over {len(times['on'])} steps"
        )
    finally:
        off.shutdown()
        on.shutdown()
