"""`python -m helexa.server --tensor-parallel-size 2` on CPU (gloo): the OpenAI client gets what TP 1 serves,
the admission and metrics routes show one pool, and no worker survives the server (Ctrl-C or SIGKILL)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest

from tests.parallel.conftest import pid_alive
from tests.support.servers import RunningServer, make_tiny_model_dir, metric, tiny_engine_config, wait_for

REPO = Path(__file__).resolve().parents[2]
QUESTIONS = ["hello world", "the quick brown fox", "paged cache block attention kernel"]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tp_server"), max_position_embeddings=512)


def _answers(server: RunningServer) -> list[str]:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    answers = []
    for q in QUESTIONS:
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": q}], max_tokens=8, temperature=0.0
        )
        answers.append(reply.choices[0].message.content or "")
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": QUESTIONS[0]}], max_tokens=8, temperature=0.0, stream=True
    )
    answers.append("".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices))
    return answers


def test_openai_client_at_tp2_gets_what_tp1_serves(chat_model: Path) -> None:
    config = tiny_engine_config(chat_model, num_blocks=96, max_num_seqs=4, max_model_len=512)
    single = RunningServer(config)
    try:
        want = _answers(single)
    finally:
        single.stop()
    server = RunningServer(config.replace(tensor_parallel_size=2))
    pids = server.engine.runner.group.worker_pids
    try:
        got = _answers(server)
        admission = httpx.get(f"{server.url}/v1/admission", timeout=10).json()
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    finally:
        server.stop()
    assert got == want and got[-1] == got[0] and any(got)
    # one pool: the agreed block count, once, in both routes
    assert admission["blocks_total"] == 96 and admission["blocks_reserved"] == 0
    assert admission["model_state"] == "loaded"
    assert metric(metrics, "helexa_kv_blocks_total") == 96
    assert sum(line.startswith("helexa_kv_blocks_total ") for line in metrics.splitlines()) == 1
    assert not any(pid_alive(p) for p in pids)


def _children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def _start_cli(chat_model: Path) -> tuple[subprocess.Popen, list[str]]:
    argv = ["--model", str(chat_model), "--device", "cpu", "--dtype", "float32", "--attention-backend", "torch",
            "--num-blocks", "64", "--port", "0", "--tensor-parallel-size", "2",
            "--shutdown-grace-secs", "1"]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "helexa.server", *argv],
        cwd=REPO,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: the test's Ctrl-C reaches it and its workers only
    )
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))

    threading.Thread(target=read, daemon=True).start()
    up = wait_for(lambda: any("helexa: serving" in x for x in lines) or proc.poll() is not None, 90)
    assert up and proc.poll() is None, "\n".join(lines)
    return proc, lines


@pytest.mark.parametrize("how", ["ctrl-c", "sigkill"])
def test_no_worker_outlives_the_server(chat_model: Path, how: str) -> None:
    proc, lines = _start_cli(chat_model)
    try:
        workers = _children(proc.pid)
        assert len([p for p in workers if pid_alive(p)]) >= 1, workers
        if how == "ctrl-c":  # SIGINT to the whole group, as a terminal sends it: workers ignore it, the server drains
            os.killpg(proc.pid, signal.SIGINT)
            assert proc.wait(timeout=60) == 0, "\n".join(lines)
            assert any("tensor parallel: stopped 1 workers (exit codes [0])" in x for x in lines), "\n".join(lines)
        else:  # the server dies at once: each worker sees its lifeline close and exits
            proc.kill()
            proc.wait(timeout=10)
        assert wait_for(lambda: not any(pid_alive(p) for p in workers), 10), workers
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
