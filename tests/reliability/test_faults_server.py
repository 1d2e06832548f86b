"""Injected device faults through the real server and the official `openai` client: invisible except as latency.

The same requests run on a clean server and on one whose engine faults at chosen model steps
(HELEXA_FAULT_INJECT): the streamed texts are identical (greedy, and seeded sampling too), the fault
and reload counters move, and the KV budget (`blocks_total`) is the same before and after.
"""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import openai

from helexa.server.cli import build_parser, configs_from_args
from tests.support.servers import RunningServer, metric, serving, wait_for

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me about the sea."}]


def _client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _streams(server: RunningServer) -> dict[str, str]:
    """Three streaming requests at once (greedy chat, greedy completion, seeded completion); their texts."""
    client = _client(server)
    out: dict[str, str] = {}

    def chat() -> None:
        stream = client.chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=40, temperature=0.0, stream=True, extra_body={"ignore_eos": True}
        )
        out["chat"] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    def completion(name: str, **sampling) -> None:
        stream = client.completions.create(
            model="tiny",
            prompt="the quick brown fox " * 3,
            max_tokens=30,
            stream=True,
            extra_body={"ignore_eos": True},
            **sampling,
        )
        out[name] = "".join(c.choices[0].text for c in stream if c.choices)

    threads = [
        threading.Thread(target=chat),
        threading.Thread(target=completion, args=("greedy",), kwargs={"temperature": 0.0}),
        threading.Thread(target=completion, args=("seeded",), kwargs={"temperature": 0.9, "seed": 11}),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert set(out) == {"chat", "greedy", "seeded"}, f"a stream did not finish: got {sorted(out)}"
    return out


def test_faulted_streams_equal_unfaulted(tiny_model_dir: Path) -> None:
    with serving(tiny_model_dir, num_blocks=128) as clean:
        expected = _streams(clean)
    # Step 2: the first decode of the batch (mid-prefill for nobody, everyone running); step 9: mid-decode.
    with serving(tiny_model_dir, "2,9", num_blocks=128, fault_backoff_secs=0.0) as faulty:
        before = httpx.get(f"{faulty.url}/v1/admission", timeout=10).json()
        metrics = httpx.get(f"{faulty.url}/metrics", timeout=10).text
        assert metric(metrics, "helexa_device_faults_total") == 0 and metric(metrics, "helexa_model_reloads_total") == 0
        got = _streams(faulty)
        assert all(len(text) > 0 for text in got.values())
        assert got == expected  # the faults are invisible in the output
        metrics = httpx.get(f"{faulty.url}/metrics", timeout=10).text
        assert metric(metrics, "helexa_device_faults_total") == 2
        assert metric(metrics, "helexa_model_reloads_total") == 2
        assert wait_for(lambda: httpx.get(f"{faulty.url}/v1/admission", timeout=10).json()["blocks_reserved"] == 0, 5)
        after = httpx.get(f"{faulty.url}/v1/admission", timeout=10).json()
        assert after["blocks_total"] == before["blocks_total"] == 128
        assert after["blocks_in_use"] == 0 and after["model_state"] == "loaded"
        assert httpx.get(f"{faulty.url}/health", timeout=10).json()["status"] == "ok"
        faulty.engine.check_integrity()


def test_fault_flags_reach_the_engine_config() -> None:
    engine, _ = configs_from_args(
        build_parser().parse_args(["--max-fault-retries", "0", "--fault-backoff-secs", "2.5"])
    )
    assert (engine.max_fault_retries, engine.fault_backoff_secs) == (0, 2.5)
    defaults, _ = configs_from_args(build_parser().parse_args([]))
    assert (defaults.max_fault_retries, defaults.fault_backoff_secs) == (3, 0.5)
