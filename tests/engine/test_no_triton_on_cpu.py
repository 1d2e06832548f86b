"""A CPU engine never imports Triton: it runs no Triton kernel (the torch references and helexa's native
kernels do the work), and the package is ~50 MiB resident in every process that imports it. Triton loads
on first use of a Triton kernel (CUDA, or `TRITON_INTERPRET=1`, as the kernel tests run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

_SCRIPT = """
import json, sys
import helexa.llm, helexa.server.__main__  # what the server's and the core's processes import
from helexa.model.sampling import SamplingParams
from tests.support.engines import drive, make_engine, random_prompts
engine = make_engine(sys.argv[1], attention_backend="auto", quantization=sys.argv[2])
params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
done = drive(engine, [engine.submit(p, params) for p in random_prompts(2, seed=5)])
print(json.dumps({"finished": len(done), "triton": "triton" in sys.modules}))
"""


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_a_cpu_engine_serves_without_importing_triton(tiny_model_dir, quantization):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    run = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tiny_model_dir), quantization],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result == {"finished": 2, "triton": False}


def test_the_triton_kernels_load_on_first_use():
    code = (
        "import sys, helexa.kernels as k\n"
        "assert 'triton' not in sys.modules\n"
        "assert k.get_attention_backend('triton').paged_attention is k.paged_attention_triton\n"
        "print('triton' in sys.modules)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "True"


_LEAN_SCRIPT = """
import json, sys
import helexa.llm
from helexa.model.sampling import SamplingParams
from tests.support.engines import drive, make_engine, random_prompts
engine = make_engine(sys.argv[1])
params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
done = drive(engine, [engine.submit(p, params) for p in random_prompts(2, seed=5)])
loaded = sorted(m for m in ("zmq", "msgspec", "helexa.cluster") if m in sys.modules)
print(json.dumps({"finished": len(done), "loaded": loaded}))
"""


def test_an_engine_without_kv_events_loads_no_event_stack(tiny_model_dir):
    """`LLM`'s engine without `--kv-events-endpoint` never imports the KV-event publisher's stack (zmq,
    msgspec, helexa.cluster: ~2 MiB resident in every process that imports them)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [sys.executable, "-c", _LEAN_SCRIPT, str(tiny_model_dir)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {"finished": 2, "loaded": []}
