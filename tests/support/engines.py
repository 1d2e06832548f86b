"""Engine test support: a CPU engine on a tiny model, the configs the server tests share, and a driver
that steps an engine until its requests end (checking every invariant after each step)."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from pathlib import Path

import torch

from helexa.config import EngineConfig
from helexa.engine.engine import Engine


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to `n` inside, restored after. One thread for tiny steps on a busy
    2-core machine: with two, each tiny step was ~15x slower there (measured)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def cpu_config(model_dir: Path, **overrides) -> EngineConfig:
    """CPU, float32, the torch attention backend, 8 sequences: fast on two cores. `overrides` by flat name."""
    args = dict(model=str(model_dir), device="cpu", dtype="float32", attention_backend="torch", max_num_seqs=8)
    return EngineConfig.of(**{**args, **overrides})


def make_engine(model_dir: Path, **overrides) -> Engine:
    """An engine with a small pool (64 blocks of 8 tokens, 64 tokens a step, 30 s wait limit)."""
    small = dict(num_blocks=64, block_size=8, max_num_batched_tokens=64, max_wait_secs=30.0)
    return Engine(cpu_config(model_dir, **{**small, **overrides}))


def tiny_engine_config(model_dir: Path, **overrides) -> EngineConfig:
    """The server tests' engine: 512 blocks of 16 tokens, 512 tokens a step."""
    return cpu_config(model_dir, **{**dict(block_size=16, num_blocks=512, max_num_batched_tokens=512), **overrides})


def drive(engine: Engine, handles, max_steps: int = 2000) -> dict[str, list]:
    """Step the engine until every handle's stream has ended; check invariants after each step."""
    events: dict[str, list] = {h.request_id: [] for h in handles}
    open_ids = set(events)
    for _ in range(max_steps):
        engine.step()
        engine.check_integrity()
        for h in handles:
            while (e := h.stream.get(timeout=0)) is not None:
                events[h.request_id].append(e)
                if e.finished:
                    open_ids.discard(h.request_id)
        if not open_ids:
            return events
    raise AssertionError(f"requests {sorted(open_ids)} did not finish in {max_steps} steps")


def run_streams(engine: Engine, handles, aborts: dict[int, int] | None = None, max_steps: int = 3000,
                after_step=None) -> dict[str, list]:  # fmt: skip
    """Step until every handle's stream has ended, aborting handle i at step `aborts[i]`; check every invariant
    (and `after_step(engine)`) after each step; each stream ends with exactly one final event."""
    aborts = dict(aborts or {})
    events: dict[str, list] = {h.request_id: [] for h in handles}
    for step in range(max_steps):
        for i, at in list(aborts.items()):
            if step >= at:
                engine.abort(handles[i].request_id)
                del aborts[i]
        engine.step()
        engine.check_integrity()
        if after_step is not None:
            after_step(engine)
        for h in handles:
            while (e := h.stream.get(timeout=0)) is not None:
                events[h.request_id].append(e)
        if all(ev and ev[-1].finished for ev in events.values()):
            break
    else:
        raise AssertionError("requests did not finish")
    for ev in events.values():
        assert sum(e.finished for e in ev) == 1  # exactly one final event per stream
    return events


def _tokens(events) -> list[int]:
    return [t for e in events for t in e.token_ids]


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 400) for _ in range(rng.randint(1, 40))] for _ in range(n)]


def tokens(events) -> list[int]:
    return [t for e in events for t in e.token_ids]


def random_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 400) for _ in range(rng.randint(1, 40))] for _ in range(n)]


def assert_released(engine: Engine) -> None:
    """Every request has ended: nothing reserved, and every block is empty or cached (none in use)."""
    snap = engine.snapshot()
    assert snap["blocks_reserved"] == 0 and snap["in_flight"] == 0 and snap["queue_depth"] == 0
    cache = engine.kv.prefix_cache
    cached = cache.num_cached if cache is not None else 0
    assert snap["blocks_in_use"] == 0 and snap["blocks_cached"] == cached
    assert engine.pool.num_free_blocks + cached == engine.pool.num_blocks
    assert engine.kv.keys() == []  # the KV owner has forgotten every request
