"""The serving processes' frozen heap (`helexa.heap`): frozen objects are out of the collector's walks, a
thaw frees their cyclic garbage, and a reload after a device fault thaws (the old model is freed) and
freezes again."""

from __future__ import annotations

import gc
import platform
import subprocess
import sys
import weakref

import pytest

from helexa.heap import HeapLevel, freeze_heap, resident_bytes, trim_heap
from helexa.model.sampling import SamplingParams
from tests.support.engines import drive, make_engine, random_prompts


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


@pytest.fixture
def thawed_after():
    yield
    gc.unfreeze()


_THAW_PROBE = """
import gc, weakref
from helexa.heap import freeze_heap, thaw_heap
class Node:
    def __init__(self):
        self.me = self  # a cycle: only the collector frees it
node = Node()
gone = weakref.ref(node)
assert freeze_heap("test") == gc.get_freeze_count() > 0
del node  # cyclic garbage among the frozen objects
gc.collect()
assert gone() is not None  # the collector no longer walks it
frozen = gc.get_freeze_count()
assert thaw_heap() == frozen
assert gone() is None and gc.get_freeze_count() == 0
assert thaw_heap() == 0  # nothing frozen: a second thaw says so
print("ok")
"""


def test_frozen_cyclic_garbage_waits_for_the_thaw():
    """Frozen cyclic garbage outlives a collection and goes at the thaw, which returns the frozen count. In a
    fresh interpreter: in this one other tests' threads may free frozen objects (a frozen object whose count
    drops to zero leaves the frozen set) between reading the count and the thaw."""
    probe = subprocess.run([sys.executable, "-c", _THAW_PROBE], capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split() == ["ok"]


def test_a_reload_frees_the_old_model_and_freezes_again(tiny_model_dir, monkeypatch, thawed_after):
    monkeypatch.setenv("HELEXA_FAULT_INJECT", "2")
    engine = make_engine(tiny_model_dir, fault_backoff_secs=0.0)
    old_runner = weakref.ref(engine.runner)
    old_model_cycle = _Node()  # something of the loaded model's age that only the collector frees
    engine.runner.heap_probe = old_model_cycle
    old_cycle = weakref.ref(old_model_cycle)
    del old_model_cycle
    freeze_heap("test")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    drive(engine, [engine.submit(p, params) for p in random_prompts(2, seed=3)])
    assert engine.counters.model_reloads == 1
    assert old_runner() is None and old_cycle() is None  # thawed before the reload: the old model was freed
    assert gc.get_freeze_count() > 0  # and frozen again after it


def _fragmented(mib: int) -> list[bytearray]:
    """`mib` MiB of 4 KiB buffers (above pymalloc's 512 B: the C heap's; zeroed: resident), all but every 64th
    freed again: the freed pages stay in the heap, fragmented by the kept ones. Returns the kept ones."""
    held = [bytearray(4096) for _ in range(mib * 256)]
    return held[::64]


def test_trim_hands_freed_heap_back_to_the_os():
    """Freed C-heap memory below a live allocation stays resident until `trim_heap`: 64 MiB of 4 KiB buffers,
    all but every 64th freed, come back (a no-op trim, or one that measured nothing, fails this)."""
    if resident_bytes() == 0:
        pytest.skip("no /proc here to measure the resident set")
    trim_heap("before the test")
    kept = _fragmented(64)
    released = trim_heap("test")
    assert len(kept) == 256
    assert released > 32 * 2**20


_LARGE_BLOCK_PROBE = """
import ctypes, sys
from helexa.heap import resident_bytes, return_large_blocks
if sys.argv[1] == "fixed":
    assert return_large_blocks()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
first = libc.malloc(24 << 20)  # mapped (over the default 128 KiB); freeing it raises glibc's threshold to 24 MiB
libc.free(first)
pin = libc.malloc(1 << 10)  # something live above the next block: it cannot be given back by shrinking the heap
block = libc.malloc(16 << 20)
top = libc.malloc(1 << 10)
ctypes.memset(block, 1, 16 << 20)  # resident
before = resident_bytes()
libc.free(block)
print(before - resident_bytes())
"""


@pytest.mark.parametrize("threshold", ["glibc's", "fixed"])
def test_a_freed_large_block_leaves_the_resident_set(threshold: str) -> None:
    """After one large block is freed, glibc serves the next ones from its heap and keeps them resident once
    freed (its dynamic threshold); with `return_large_blocks` a freed 16 MiB block leaves the resident set at
    once. Each case in a fresh process (the setting is process-wide); the default's case shows the probe can
    fail."""
    if resident_bytes() == 0 or sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("needs glibc's allocator and /proc")
    probe = subprocess.run(
        [sys.executable, "-c", _LARGE_BLOCK_PROBE, threshold], capture_output=True, text=True, timeout=120, check=True
    )
    released = int(probe.stdout.split()[-1])
    if threshold == "fixed":
        assert released >= 15 * 2**20
    else:
        assert released < 2**20


def test_heap_level_trims_once_the_resident_set_grew_by_its_slack():
    """`HeapLevel.check` leaves growth under its slack alone and hands the heap's free pages back once the
    resident set has grown by the slack: a check that never trims, or trims at every call, fails this."""
    if resident_bytes() == 0 or sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("needs glibc's allocator and /proc")
    trim_heap("before the test")
    level = HeapLevel(slack=16 * 2**20, interval=0.0)
    assert not level.check()  # nothing grew
    kept = _fragmented(6)  # ~6 MiB resident, all but 1/64 of it free heap: under the slack
    assert not level.check() and level.trims == 0
    kept += _fragmented(40)  # now well over it
    assert level.check()
    assert level.trims == 1 and level.released > 16 * 2**20
    assert not level.check()  # the level is set again after the trim
    assert len(kept) == 6 * 4 + 40 * 4


def test_the_engine_checks_its_heap_after_every_step(tiny_model_dir):
    """Every step that ran the model ends with one `HeapLevel.check`."""
    engine = make_engine(tiny_model_dir)
    checks: list[int] = []
    engine.heap.check = lambda: checks.append(engine._step_no) or False  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    drive(engine, [engine.submit(p, params) for p in random_prompts(2, seed=5)])
    assert checks and checks == list(range(1, len(checks) + 1))


def test_heap_level_trims_at_most_once_per_interval():
    """However fast the heap grows, `HeapLevel.check` trims at most once per `interval` seconds (a step whose
    working set exceeds the slack must not trim, and fault its pages back, at every step)."""
    if resident_bytes() == 0 or sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("needs glibc's allocator and /proc")
    trim_heap("before the test")
    level = HeapLevel(slack=4 * 2**20, interval=3600.0)
    kept = _fragmented(24)
    assert level.check() and level.trims == 1
    kept += _fragmented(24)  # grown past the slack again, within the interval
    assert not level.check() and level.trims == 1
    assert len(kept) == 2 * 24 * 4
