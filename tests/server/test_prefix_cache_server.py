"""The prefix cache through the HTTP API: an agent's conversation on the default model, usage, fields, metrics."""

from __future__ import annotations

import httpx
import openai
import pytest

from helexa.server.cli import build_parser, configs_from_args
from tests.support.servers import RunningServer, metric, serving

TOOL_RESULTS = [
    "[tool result] src/cache.py  2412 bytes\nsrc/queue.py  1733 bytes\ntests/test_cache.py  980 bytes",
    "[tool result] src/cache.py:41:    return self._blocks.pop(key)\nsrc/cache.py:77:    self._lru.move_to_end(key)",
    "[tool result] tests/test_cache.py::test_evict PASSED\ntests/test_cache.py::test_lru FAILED",
    "[tool result] diff --git a/src/cache.py b/src/cache.py\n-    self._lru.pop(0)\n+    self._lru.popitem(False)",
    "[tool result] 12 passed, 0 failed in 0.41s",
]


def _conversation(url: str, turns: int) -> list[tuple[str, int, int]]:
    """An agent's turns, each resending the whole conversation: (answer, prompt tokens, cached tokens) per turn."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [
        {"role": "system", "content": "You are a coding agent. Read tool results and say what to do next."},
        {"role": "user", "content": "The LRU cache evicts the wrong entry. Find the bug and fix it."},
    ]
    seen = []
    for turn in range(turns):
        reply = client.chat.completions.create(
            model="helexa", messages=messages, temperature=0.0, max_tokens=24,
            extra_body={"prompt_cache_key": "agent-session-1"},
        )  # fmt: skip
        answer = reply.choices[0].message.content
        seen.append((answer, reply.usage.prompt_tokens, reply.usage.prompt_tokens_details.cached_tokens))
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": TOOL_RESULTS[turn % 5]}]
    return seen


def test_a_six_turn_agent_conversation_is_the_same_with_the_cache_and_reuses_it(default_model_dir) -> None:
    with serving(default_model_dir, prefix_cache=False) as off:
        without = _conversation(off.url, 6)
    with serving(default_model_dir) as on:
        with_cache = _conversation(on.url, 6)
        snap = httpx.get(f"{on.url}/v1/admission", timeout=10).json()
        text = httpx.get(f"{on.url}/metrics", timeout=10).text
    assert [a for a, _, _ in with_cache] == [a for a, _, _ in without]  # token for token (greedy)
    assert [p for _, p, _ in with_cache] == [p for _, p, _ in without]
    assert all(c == 0 for _, _, c in without)
    cached = [c for _, _, c in with_cache]
    assert cached[0] == 0 and all(b > a for a, b in zip(cached, cached[1:])), cached
    assert all(c % 16 == 0 and c < p for _, p, c in with_cache)  # whole blocks, the last token computed
    assert snap["blocks_in_use"] == 0 and snap["blocks_retained"] > 0  # the session's blocks are retained
    assert snap["blocks_empty"] + snap["blocks_cached"] == snap["blocks_total"]
    assert metric(text, "helexa_prefix_cache_hit_tokens_total") == sum(cached)
    assert metric(text, "helexa_prefix_cache_query_tokens_total") == sum(p for _, p, _ in with_cache)
    assert metric(text, "helexa_kv_blocks_retained") == snap["blocks_retained"]


def test_usage_reports_cached_tokens_on_every_api(server: RunningServer, client: openai.OpenAI) -> None:
    prompt = "cached tokens are reported " * 12
    for _ in range(2):
        done = client.completions.create(model="m", prompt=prompt, max_tokens=2, temperature=0.0)
    assert done.usage.prompt_tokens_details.cached_tokens > 0
    salted = client.completions.create(model="m", prompt=prompt, max_tokens=2, extra_body={"cache_salt": "tenant-9"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0  # another tenant shares nothing
    for _ in range(2):
        resp = client.responses.create(model="m", input=prompt, max_output_tokens=2, prompt_cache_key="r")
    assert resp.usage.input_tokens_details.cached_tokens > 0
    chat = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": prompt}], max_tokens=2, n=3, temperature=0.0
    )
    assert chat.usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.parametrize(
    "field, value",
    [("prompt_cache_key", 5), ("prompt_cache_key", ""), ("cache_salt", ["a"]), ("cache_salt", "x" * 1025)],
)
def test_bad_cache_fields_are_400_naming_the_field(server: RunningServer, field: str, value) -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 1, field: value}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == field


def test_no_prefix_cache_flag() -> None:
    parser = build_parser()
    on, _ = configs_from_args(parser.parse_args([]))
    off, _ = configs_from_args(parser.parse_args(["--no-prefix-cache", "--prefix-retention-secs", "30"]))
    assert (on.prefix_cache, on.prefix_retention_secs) == (True, 600.0)
    assert (off.prefix_cache, off.prefix_retention_secs) == (False, 30.0)
    assert "--no-prefix-cache" in parser.format_help()
