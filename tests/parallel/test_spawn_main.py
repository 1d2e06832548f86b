"""The workers never import the user's `__main__`: `LLM(tensor_parallel_size=2)` works from code piped on
stdin (`python -`) and from a script without an `if __name__ == "__main__":` guard, and a worker that
cannot start is reported with its stderr."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helexa.engine.parallel import group as tp_group
from helexa.model.config import ModelConfig
from tests.parallel.conftest import pid_alive, tp_engine
from tests.support.engines import cpu_config

REPO = Path(__file__).resolve().parents[2]

# No guard, at module level: a spawned child that re-ran this would build a second LLM (and fail).
SCRIPT = """\
import json, sys
from helexa import LLM, SamplingParams

print("module body runs in", __name__, file=sys.stderr)
llm = LLM({model!r}, device="cpu", dtype="float32", attention_backend="torch", num_blocks=64, block_size=8,
          max_num_batched_tokens=32, max_num_seqs=4, tensor_parallel_size=2)
pids = llm.engine.runner.group.worker_pids
out = llm.generate(["hello world", "the quick brown fox"],
                   SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
print(json.dumps({{"pids": pids, "tokens": [o.token_ids for o in out]}}))
{ending}
"""


def _run(args: list[str], stdin: str | None, tmp_path: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, *args], input=stdin, capture_output=True, text=True, cwd=tmp_path, timeout=180
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.stderr.count("module body runs in") == 1, proc.stderr[-4000:]  # only in the parent
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result["pids"]) == 1 and [len(t) for t in result["tokens"]] == [4, 4]
    assert not any(pid_alive(p) for p in result["pids"])  # the worker ended with the script
    return result


def test_code_piped_on_stdin(tiny_models, tmp_path: Path) -> None:
    script = SCRIPT.format(model=str(tiny_models["llama"]), ending="llm.close()")
    _run(["-"], script, tmp_path)


def test_script_without_a_main_guard(tiny_models, tmp_path: Path) -> None:
    path = tmp_path / "no_guard.py"
    path.write_text(SCRIPT.format(model=str(tiny_models["llama"]), ending="# no close(): workers stop at exit"))
    with_file = _run([str(path)], None, tmp_path)
    # the same tokens from code on stdin (greedy): the file's run was a normal one
    piped = _run(["-"], SCRIPT.format(model=str(tiny_models["llama"]), ending=""), tmp_path)
    assert with_file["tokens"] == piped["tokens"]


def test_a_worker_that_cannot_start_is_described_with_its_stderr(tiny_models, monkeypatch) -> None:
    bootstrap = "import sys\nsys.stderr.write('no such interpreter feature: boom\\n')\nsys.exit(3)\n"
    monkeypatch.setattr(tp_group, "_BOOTSTRAP", bootstrap)
    config = cpu_config(tiny_models["llama"], tensor_parallel_size=2, num_blocks=64, block_size=8)
    spec = tp_group.WorkerSpec(
        config=config,
        model_dir=str(tiny_models["llama"]),
        dtype=torch.float32,
        device_type="cpu",
        max_model_len=512,
        size=2,
        addr="127.0.0.1",
        port=tp_group.free_port(),
        timeout_secs=30.0,
        capacity=64,
    )
    group = tp_group.TensorParallelGroup.spawn(spec, ModelConfig.from_pretrained(tiny_models["llama"]))
    try:
        with pytest.raises(ValueError, match=r"(?s)rank 1 \(pid \d+\) exited with status 3.*boom"):
            group.agree(64)
    finally:
        group.close()


def test_the_engine_reports_a_worker_that_cannot_import_helexa(tiny_models, monkeypatch) -> None:
    bootstrap = tp_group._BOOTSTRAP.replace('boot["sys_path"]', '["/nonexistent"]')
    monkeypatch.setattr(tp_group, "_BOOTSTRAP", bootstrap)
    with pytest.raises(ValueError, match=r"rank 1 failed: cannot import the worker: ModuleNotFoundError"):
        tp_engine(tiny_models["llama"], 2)
