"""Tensor-parallel test support: tiny chat models per architecture, engines at TP 1 and TP N on gloo,
and a check, after every test, that no worker process is left behind."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from helexa.engine.engine import Engine
from tests.support.engines import cpu_config
from tests.support.models import build_tiny_tokenizer_dir, make_tiny_model


def tiny_chat_model(root: Path, arch: str, **overrides) -> Path:
    """A tiny random `arch` model (vocab 512, 4 heads / 2 KV heads of 16, 2 layers) with the tiny tokenizer."""
    path = make_tiny_model(root, arch, vocab_size=512, max_position_embeddings=512, name=arch, **overrides)
    build_tiny_tokenizer_dir(path)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny Llama (untied head), Qwen2 (q/k/v biases) and Qwen3 (q/k norms, tied embeddings)."""
    root = tmp_path_factory.mktemp("tp_models")
    return {
        "llama": tiny_chat_model(root, "llama", seed=1),
        "qwen2": tiny_chat_model(root, "qwen2", seed=2),
        "qwen3": tiny_chat_model(root, "qwen3", seed=3, tie_word_embeddings=True),
    }


def tp_engine(model_dir: Path, tensor_parallel_size: int, **overrides) -> Engine:
    """A CPU float32 engine over gloo: 64 blocks of 8 tokens, 32 tokens a step, no reload backoff."""
    small = dict(num_blocks=64, block_size=8, max_num_batched_tokens=32, fault_backoff_secs=0.0)
    return Engine(cpu_config(model_dir, tensor_parallel_size=tensor_parallel_size, **{**small, **overrides}))


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def child_pids() -> set[int]:
    """The live (not zombie) child processes of this process: the workers are plain subprocesses, which
    `multiprocessing.active_children()` does not list."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue
        if int(ppid) == os.getpid() and state != "Z":
            found.add(int(entry))
    return found


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[-80:]
    except OSError:
        return "?"


@pytest.fixture(autouse=True)
def no_orphans() -> Iterator[None]:
    """Fails a test that leaves a child process running (and kills it, so the next test starts clean)."""
    before = child_pids()
    before_mp = {p.pid for p in mp.active_children()}
    yield
    left = sorted(child_pids() - before)
    described = [(pid, _command(pid)) for pid in left]
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    left_mp = [p for p in mp.active_children() if p.pid not in before_mp]
    for proc in left_mp:
        proc.kill()
        proc.join(5)
    assert not left and not left_mp, f"processes left running: {described} {[(p.name, p.pid) for p in left_mp]}"


@pytest.fixture
def fault_env(monkeypatch: pytest.MonkeyPatch):
    """Sets the fault-injection variables for the engines built inside the returned context."""

    def set_env(**values: str) -> None:
        for name, value in values.items():
            monkeypatch.setenv(name, value)

    yield set_env
    for name in ("HELEXA_FAULT_INJECT", "HELEXA_FAULT_INJECT_RANK", "HELEXA_FAULT_INJECT_MODE"):
        os.environ.pop(name, None)
