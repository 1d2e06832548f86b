"""What a benchmark table says about the machine it ran on."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def cpu_name() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def memory_mib() -> dict[str, float]:
    """This process's memory now, in MiB: `rss` (resident), `peak` (the most it has been resident,
    VmHWM), `anon` and `file` (the resident anonymous and file-backed parts; mmap'd weights are file)."""
    names = {"VmRSS": "rss", "VmHWM": "peak", "RssAnon": "anon", "RssFile": "file"}
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in names:
            out[names[key]] = int(value.split()[0]) / 1024
    return out


def cpu_has_amx() -> bool:
    """True when the CPU reports AMX tiles (then llama.cpp's extra buffer types stay off)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " amx_tile" in line for line in f)
    except OSError:
        return False


SAMPLE_FDS = "HELEXA_BENCH_SAMPLE_FDS"  # "request,reply": the pipe ends an engine's process asks through


def sample_bandwidth() -> float | None:
    """Ask the benchmark's parent process to measure the machine's read bandwidth now, and wait for it
    (bytes/s): this process sits idle meanwhile, so the sample sees the machine as this process's run
    right before or after it did. None when the parent gave no pipe (see `bench/peers.py`)."""
    fds = os.environ.get(SAMPLE_FDS)
    if not fds:
        return None
    request, reply = (int(fd) for fd in fds.split(","))
    os.write(request, b"?")
    answer = b""
    while not answer.endswith(b"\n"):
        chunk = os.read(reply, 64)
        if not chunk:
            raise RuntimeError("the benchmark's parent closed the bandwidth pipe")
        answer += chunk
    return float(answer)


def paired_segments(
    segments: int, prompts: Sequence[Sequence[int]], decode: Callable[[Sequence[int]], tuple[int, float, float]]
) -> list[dict[str, Any]]:
    """One-stream decode runs held against the bandwidth of their own moment: `decode(prompt)` (tokens
    decoded after the first, their seconds, the share of them from accepted speculative drafts) for
    `segments` prompts in turn, the read bandwidth sampled (`sample_bandwidth`) before the first and
    after each, so every run has a sample right before and right after it. [] without a parent to sample."""
    before = sample_bandwidth() if segments > 0 else None
    if before is None:
        return []
    out = []
    for i in range(segments):
        tokens, seconds, accepted = decode(prompts[i % len(prompts)])
        after = sample_bandwidth()
        out.append({"tokens": tokens, "seconds": seconds, "accepted": accepted, "bandwidth": [before, after]})
        before = after
    return out
