"""Speculative decoding through the server, on the default model and the official client: a streamed answer
with drafts equals the answer of a request that opts out; the totals reach `/v1/admission`, `/metrics` and
the operator page's data; a bad `speculative` field is a 400 naming it."""

from __future__ import annotations

import inspect
import textwrap

import httpx
import openai

from tests.support.servers import serving, wait_for

SOURCE = inspect.getsource(textwrap.indent)


def test_drafts_change_nothing_a_client_sees_and_are_counted(default_model_dir) -> None:
    with serving(default_model_dir, num_blocks=256, max_num_seqs=4) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        ask = dict(
            model="m",
            messages=[{"role": "user", "content": f"Repeat this code exactly:\n```python\n{SOURCE}```"}],
            max_tokens=80, temperature=0.0, logprobs=True, top_logprobs=2,
        )  # fmt: skip
        plain = client.chat.completions.create(**ask, extra_body={"speculative": False})
        before = server.engine.snapshot()["spec_draft_tokens"]
        assert before == 0  # the opted-out request drafted nothing
        chunks = list(client.chat.completions.create(**ask, stream=True))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        logprobs = [lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.content]
        assert streamed == plain.choices[0].message.content
        assert [(lp.token, lp.logprob) for lp in logprobs] == [
            (lp.token, lp.logprob) for lp in plain.choices[0].logprobs.content
        ]
        snap = httpx.get(f"{server.url}/v1/admission").json()
        assert snap["spec_draft_tokens"] >= snap["spec_accepted_tokens"] > 0 and snap["spec_drafts"] > 0
        assert 0 < snap["spec_acceptance_rate"] <= 1 and snap["spec_mean_accepted_length"] > 0
        metrics = httpx.get(f"{server.url}/metrics").text
        assert f"helexa_spec_accepted_tokens_total {float(snap['spec_accepted_tokens'])}" in metrics
        assert "helexa_spec_draft_tokens_total" in metrics and "helexa_spec_drafts_total" in metrics
        page = httpx.get(f"{server.url}/v1/dashboard").json()
        assert page["admission"]["spec_acceptance_rate"] == snap["spec_acceptance_rate"]
        bad = httpx.post(f"{server.url}/v1/chat/completions", json={**ask, "speculative": "yes"})
        assert bad.status_code == 400 and "speculative" in bad.json()["error"]["message"]
        idle = lambda: server.engine.snapshot()["blocks_reserved"] == 0  # noqa: E731
        assert wait_for(idle, 5)
