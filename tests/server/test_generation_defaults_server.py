"""The model's generation_config.json sampling defaults in the server: fields a request omits take them,
fields it sends keep their own values; `--generation-config none` turns them off."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from helexa.model.generation_defaults import SamplingDefaults
from helexa.server.generation import GenerationRun
from helexa.server.protocol import parse_completion
from tests.support.servers import make_tiny_model_dir, serving

# ---------------------------------------------------------------- GenerationRun.sampling_params (no model)


def _run(defaults: SamplingDefaults, body: dict[str, Any], prompt_lens: list[int], *, node_default: int = 4096,
         max_model_len: int = 1000) -> GenerationRun:  # fmt: skip
    engine = SimpleNamespace(
        sampling_defaults=defaults,
        max_model_len=max_model_len,
        config=SimpleNamespace(admission=SimpleNamespace(default_max_tokens=node_default)),
    )
    req = parse_completion({"prompt": ["x"] * len(prompt_lens), **body})
    return GenerationRun(engine, "cmpl-test", [[1] * n for n in prompt_lens], req)  # type: ignore[arg-type]


FILE = SamplingDefaults(source=Path("generation_config.json"), temperature=0.2, top_p=0.9, top_k=40, max_tokens=100)


def test_omitted_fields_take_the_defaults_sent_ones_win() -> None:
    omitted = _run(FILE, {}, [10]).sampling_params(0)
    assert (omitted.temperature, omitted.top_p, omitted.top_k, omitted.min_p) == (0.2, 0.9, 40, 0.0)
    sent = _run(FILE, {"temperature": 0, "top_k": -1, "min_p": 0.1}, [10])
    params = sent.sampling_params(0)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0, 0.9, -1, 0.1)
    assert sent.sampling == {"temperature": 0, "top_p": 0.9, "top_k": -1, "min_p": 0.1}


def test_no_defaults_change_nothing() -> None:
    run = _run(SamplingDefaults(), {"top_p": 0.5}, [10])
    assert run.sampling == {"top_p": 0.5}
    params = run.sampling_params(0)
    assert (params.temperature, params.top_p, params.max_tokens) == (1.0, 0.5, None)


def test_max_new_tokens_lowers_the_node_default_within_the_context() -> None:
    assert _run(FILE, {}, [10]).sampling_params(0).max_tokens == 100
    assert _run(FILE, {}, [950]).sampling_params(0).max_tokens == 50  # what is left of the context
    assert _run(FILE, {}, [1000]).sampling_params(0).max_tokens == 1  # admission refuses it, as with None
    assert _run(FILE, {"max_tokens": 500}, [10]).sampling_params(0).max_tokens == 500  # the client's wins
    assert _run(FILE, {}, [10], node_default=64).sampling_params(0).max_tokens is None  # the node's is lower
    two = _run(FILE, {"n": 2}, [10, 960])  # choices 2 and 3 are the second prompt's
    assert [two.sampling_params(k).max_tokens for k in range(4)] == [100, 100, 40, 40]


# ---------------------------------------------------------------- through a real server


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny chat model; its generation_config.json recommends greedy decoding, top_k 5, 8 new tokens."""
    path = make_tiny_model_dir(tmp_path_factory.mktemp("gen_defaults_server"), max_position_embeddings=256)
    config = json.loads((path / "generation_config.json").read_text())
    config.update(temperature=0.0, top_k=5, max_new_tokens=8, do_sample=True)
    (path / "generation_config.json").write_text(json.dumps(config))
    return path


PROMPT = "the quick brown fox"


def _complete(client: httpx.Client, **body: Any) -> dict[str, Any]:
    response = client.post("/v1/completions", json={"prompt": PROMPT, **body})
    assert response.status_code == 200, response.text
    return response.json()


def _text(client: httpx.Client, **body: Any) -> str:
    return _complete(client, **body)["choices"][0]["text"]


def test_requests_without_temperature_follow_the_model(model_dir: Path) -> None:
    with serving(model_dir) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        assert server.engine.sampling_defaults.values() == {"temperature": 0.0, "top_k": 5, "max_tokens": 8}
        greedy = _text(client, temperature=0)
        assert greedy  # (this seed's model does not end at once: the comparisons below say something)
        # Unseeded and without temperature: the model's default (greedy), so every answer is the same.
        assert _text(client) == _text(client) == greedy
        assert _text(client, seed=7) == greedy
        chat = {"messages": [{"role": "user", "content": PROMPT}]}
        answers = [client.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"] for _ in range(2)]
        assert answers[0] == answers[1]
        # max_new_tokens is the default output limit; the client's max_tokens wins.
        full = _complete(client, ignore_eos=True)
        assert full["usage"]["completion_tokens"] == 8 and full["choices"][0]["finish_reason"] == "length"
        assert _complete(client, ignore_eos=True, max_tokens=11)["usage"]["completion_tokens"] == 11
        sampled_here = _text(client, seed=7, temperature=1.0, top_k=-1)

    with serving(model_dir, generation_config="none") as server, httpx.Client(base_url=server.url, timeout=30) as c:
        assert server.engine.sampling_defaults == SamplingDefaults()
        # Without defaults an omitted temperature is helexa's 1.0: the same seeded sample as sending it.
        unsent = _text(c, seed=7, max_tokens=8)
        assert unsent == _text(c, seed=7, max_tokens=8, temperature=1.0)
        # The request that sent every field the file sets sampled exactly as here, where no file applies.
        assert unsent == sampled_here
