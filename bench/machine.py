"""What a benchmark table says about the machine it ran on."""

from __future__ import annotations

from pathlib import Path


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
