"""The routes vLLM's and SGLang's routers call on a backend: render, load and capacity, server and model info,
and the cache flush (helexa/server/backend.py), against a real server over the tiny model."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from helexa.server.settings import ServerSettings
from tests.support.servers import RunningServer, serving, wait_for

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
CHAT = {"model": "tiny-chat", "messages": MESSAGES}


def test_chat_render_gives_the_ids_generation_uses(server: RunningServer) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        rendered = http.post("/v1/chat/completions/render", json={**CHAT, "max_tokens": 3}).json()
        tokenized = http.post("/tokenize", json={"messages": CHAT["messages"], "add_generation_prompt": True}).json()
        done = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1}).json()
    assert rendered["token_ids"] == tokenized["tokens"]
    assert len(rendered["token_ids"]) == done["usage"]["prompt_tokens"]
    assert rendered["model"] == server.engine.model_name
    assert rendered["sampling_params"]["max_tokens"] == 3
    assert isinstance(rendered["request_id"], str) and rendered["features"] is None


def test_completion_render_answers_a_list_one_per_prompt(server: RunningServer) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        rendered = http.post("/v1/completions/render", json={"model": "m", "prompt": ["one two", "three"]}).json()
        ids = [http.post("/tokenize", json={"prompt": p}).json()["tokens"] for p in ("one two", "three")]
        as_ids = http.post("/v1/completions/render", json={"model": "m", "prompt": [5, 6, 7]}).json()
    assert [r["token_ids"] for r in rendered] == ids
    assert [r["token_ids"] for r in as_ids] == [[5, 6, 7]]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions/render", {"model": "m"}, "messages"),
        ("/v1/completions/render", {"model": "m"}, "prompt"),
        ("/v1/completions/render", {"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ],
)
def test_render_refuses_bad_input_with_an_openai_400(server: RunningServer, path: str, body: dict, param: str) -> None:
    reply = httpx.post(server.url + path, json=body, timeout=30)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == param
    assert reply.json()["error"]["type"] == "invalid_request_error"


def test_get_load_and_capacity_are_admissions_numbers_on_an_idle_server(server: RunningServer) -> None:
    assert wait_for(lambda: server.engine.snapshot()["in_flight"] == 0, 30)
    with httpx.Client(base_url=server.url, timeout=30) as http:
        load = http.get("/get_load").json()
        cap = http.get("/v1/capacity").json()
    snap = server.engine.snapshot()
    assert load["load"] == load["num_tokens"] == snap["blocks_reserved"] * snap["block_size"] == 0
    assert load["num_reqs"] == 0 and load["num_waiting_reqs"] == 0
    assert cap["admissible_tokens"] == snap["blocks_available"] * snap["block_size"] == 256 * 16
    assert cap["estimated_wait_seconds"] == 0.0
    assert {k: cap[k] for k in cap} == {k: load[k] for k in cap}


def test_a_full_replica_reports_more_load_than_its_whole_pool_and_no_room(tiny_model_dir: Path) -> None:
    """One request holds the only sequence slot and another waits: the load counts both (reserved + queued),
    more than the pool holds, so it ranks behind any replica with room; no tokens are admissible."""
    with serving(tiny_model_dir, num_blocks=64, max_num_seqs=1, max_model_len=1024) as srv:
        body = {"model": "m", "prompt": "one two three", "max_tokens": 400, "ignore_eos": True}

        def post() -> None:
            httpx.post(srv.url + "/v1/completions", json=body, timeout=120)

        threads = [threading.Thread(target=post) for _ in range(2)]
        for t in threads:
            t.start()
            time.sleep(0.2)
        try:
            assert wait_for(lambda: srv.engine.snapshot()["queue_depth"] == 1, 30)
            load = httpx.get(srv.url + "/get_load", timeout=30).json()
            snap = srv.engine.snapshot()
            assert load["num_reqs"] == 1 and load["num_waiting_reqs"] == 1
            assert load["blocks_queued"] == 26  # ceil((3-ish prompt + 400) / 16) for the waiting request
            assert load["load"] == (snap["blocks_reserved"] + 26) * 16 > snap["blocks_total"] * 16 * 0.8
            assert load["admissible_tokens"] == 0
            assert load["estimated_wait_seconds"] > 0
        finally:
            for t in threads:
                t.join(timeout=120)


def test_server_and_model_info_in_the_routers_shapes(server: RunningServer) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        as_json = http.get("/server_info", params={"config_format": "json"}).json()["vllm_config"]
        as_text = http.get("/server_info").json()["vllm_config"]
        sgl = http.get("/get_server_info").json()
        info, alias = http.get("/get_model_info").json(), http.get("/model_info").json()
    name = server.engine.model_name
    assert json.loads(as_text) == as_json
    assert as_json["model_config"]["model"] == name and as_json["cache_config"]["block_size"] == 16
    assert as_json["cache_config"]["num_gpu_blocks"] == 256
    assert sgl["model_path"] == name and sgl["page_size"] == 16 and sgl["max_total_num_tokens"] == 256 * 16
    assert sgl["internal_states"][0]["num_reqs"] >= 0
    assert info == alias and info["model_path"] == name and info["is_generation"] is True


def test_flush_cache_evicts_cached_blocks_and_keeps_those_in_use(tiny_model_dir: Path) -> None:
    with serving(tiny_model_dir, num_blocks=128, max_num_seqs=2) as srv:
        prompt = " ".join(["alpha beta gamma delta"] * 20)
        httpx.post(srv.url + "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 1}, timeout=60)
        assert srv.engine.snapshot()["blocks_cached"] > 0
        body = {"model": "m", "prompt": prompt + " again", "max_tokens": 300, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as running:
            lines = running.iter_lines()
            next(line for line in lines if line.startswith("data:"))  # it runs: its blocks are in use
            in_use = srv.engine.snapshot()["blocks_in_use"]
            reply = httpx.post(srv.url + "/flush_cache", timeout=30)
            assert reply.status_code == 200 and "evicted" in reply.text
            after = srv.engine.snapshot()
            assert after["blocks_cached"] == 0
            assert after["blocks_in_use"] >= in_use  # nothing it held was dropped
            text = "".join(lines)
        assert "[DONE]" in text and '"error"' not in text
        assert wait_for(lambda: not srv.engine.has_work(), 30)
        srv.engine.check_integrity()  # idle: every reservation and block accounted for


def test_flush_cache_needs_the_api_key_and_load_does_not(tiny_model_dir: Path) -> None:
    with serving(tiny_model_dir, settings=ServerSettings(api_key="k3y")) as srv:
        assert httpx.post(srv.url + "/flush_cache", timeout=30).status_code == 401
        ok = httpx.post(srv.url + "/flush_cache", headers={"Authorization": "Bearer k3y"}, timeout=30)
        assert ok.status_code == 200
        assert httpx.get(srv.url + "/get_load", timeout=30).status_code == 200
        assert httpx.post(srv.url + "/v1/completions/render", json={"prompt": "x"}, timeout=30).status_code == 401
