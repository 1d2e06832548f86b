"""The KV tiers through the HTTP API: an agent's turn after its KV went to disk reports its cached tokens, answers
as the server without any cache does, and `/v1/admission`, `/metrics` and the page's data show the tier."""

from __future__ import annotations

import httpx
import openai

from tests.support.servers import serving

FILLER = " ".join(f"word{i % 97} value{i % 13}" for i in range(25))  # about 350 tokens: most of a 24-block pool


def _agent(url: str, evict: bool) -> list[tuple[str, int]]:
    """Two turns of one session (answer, cached prompt tokens), with a long unrelated request between them when
    `evict`: it needs nearly every block of the pool, so the session's retained blocks leave it."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    messages = [
        {"role": "system", "content": "You are a coding agent. Read tool results and say what to do next."},
        {"role": "user", "content": "The LRU cache evicts the wrong entry. Find the bug and fix it."},
    ]
    seen = []
    for turn in range(2):
        if turn == 1 and evict:
            other = client.completions.create(model="m", prompt=FILLER, max_tokens=4, temperature=0.0)
            assert other.usage.prompt_tokens > 300
        reply = client.chat.completions.create(
            model="m", messages=messages, temperature=0.0, max_tokens=16, extra_body={"prompt_cache_key": "agent-7"}
        )
        answer = reply.choices[0].message.content
        seen.append((answer, reply.usage.prompt_tokens_details.cached_tokens))
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "[tool result] 3 passed"}]
    return seen


def test_a_turn_after_its_kv_went_to_disk_reports_its_cached_tokens_and_answers_the_same(
    tiny_model_dir, tmp_path
) -> None:
    with serving(tiny_model_dir, prefix_cache=False, num_blocks=64) as off:
        without = _agent(off.url, evict=False)
    with serving(tiny_model_dir, num_blocks=64) as roomy:
        resident = _agent(roomy.url, evict=True)  # the pool holds everything: the session's blocks stay
    with serving(tiny_model_dir, num_blocks=24, kv_disk_path=str(tmp_path / "kv")) as tiered:
        with_disk = _agent(tiered.url, evict=True)
        snap = httpx.get(f"{tiered.url}/v1/admission", timeout=10).json()
        metrics = httpx.get(f"{tiered.url}/metrics", timeout=10).text
        page = httpx.get(f"{tiered.url}/v1/dashboard", timeout=10).json()
    assert [a for a, _ in with_disk] == [a for a, _ in without] == [a for a, _ in resident]
    assert with_disk[1][1] == resident[1][1] > 0  # every block it had computed came back (from the pool or disk)
    disk = snap["kv_tiers"]["disk"]
    assert disk["loads"] > 0 and disk["writes"] >= disk["loads"] and disk["failures"] == 0, disk
    assert snap["blocks_disk"] == disk["blocks"] > 0 and snap["blocks_host"] == 0
    assert f'helexa_kv_tier_loads_total{{tier="disk"}} {float(disk["loads"])}' in metrics
    assert f"helexa_kv_blocks_disk {float(snap['blocks_disk'])}" in metrics
    assert page["admission"]["kv_tiers"]["disk"]["blocks"] == disk["blocks"]
