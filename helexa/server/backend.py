"""What vLLM's and SGLang's routers ask of a backend, in their shapes: load, capacity, server and model
info, and the cache flush.

Every number comes from admission's snapshot (`Engine.snapshot()`, the `/v1/admission` body) read once
per answer, and the wait estimate from admission's planner (`median_wait`); nothing is recounted here.

- `GET /get_load` (SGLang's route, polled by both routers' `power_of_two`): `load` is the tokens this
  replica has committed — its reserved blocks plus the blocks its queue waits for, in tokens — so a replica
  with a queue always reports more than any replica with room; beside it SGLang's `num_reqs`,
  `num_waiting_reqs`, `num_tokens`, and helexa's capacity (below).
- `GET /v1/capacity`: the exact admission signal: `admissible_tokens` (how many more tokens of KV this
  replica grants now without anyone waiting: free blocks of the reservation ledger, 0 while requests
  queue or every sequence slot is taken) and `estimated_wait_seconds` (what a median-size request would
  wait if it arrived now).
- `GET /server_info` (vLLM; `?config_format=json` for an object, else the same as a JSON string),
  `GET /get_server_info` (SGLang), `GET /get_model_info` and `GET /model_info` (SGLang).
- `POST /flush_cache` (SGLang's route; behind the API key): evicts every cached prefix block no request
  holds (running requests keep theirs) and empties the tiers below the pool.
"""

from __future__ import annotations

import json
import math
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from helexa._version import __version__
from helexa.engine import ServingEngine
from helexa.server.errors import APIError

__all__ = ["backend_routes", "capacity", "load", "median_wait"]


def median_wait(engine: ServingEngine) -> float:
    """Seconds a request of the median recent size would wait for admission if it arrived now (NaN when even
    the default size cannot fit this pool); the number `/metrics`, `/get_load` and `/v1/capacity` report."""
    bs = engine.config.block_size  # before any request: one block of prompt and one of output
    try:
        return engine.request_sizes.median_wait(engine.admission.estimate_wait, (bs, bs))
    except ValueError:  # an observed size always fits; the default one does not in a pool of one block
        return math.nan


def capacity(snapshot: dict[str, Any], wait: float) -> dict[str, Any]:
    """The capacity signal from one admission snapshot and the median wait: `admissible_tokens` (KV tokens
    granted now without waiting), `estimated_wait_seconds`, and the numbers they come from."""
    bs = snapshot["block_size"]
    room = snapshot["queue_depth"] == 0 and snapshot["in_flight"] < snapshot["max_in_flight"]
    return {
        "admissible_tokens": snapshot["blocks_available"] * bs if room else 0,
        "estimated_wait_seconds": None if math.isnan(wait) else round(wait, 3),
        "block_size": bs,
        "blocks_total": snapshot["blocks_total"],
        "blocks_available": snapshot["blocks_available"],
        "blocks_reserved": snapshot["blocks_reserved"],
        "blocks_queued": snapshot["blocks_queued"],
        "in_flight": snapshot["in_flight"],
        "max_in_flight": snapshot["max_in_flight"],
        "queue_depth": snapshot["queue_depth"],
        "max_queue_depth": snapshot["max_queue_depth"],
    }


def load(snapshot: dict[str, Any], wait: float) -> dict[str, Any]:
    """The `/get_load` body: `load` (tokens reserved plus tokens queued), SGLang's request counts, and the
    capacity signal."""
    committed = (snapshot["blocks_reserved"] + snapshot["blocks_queued"]) * snapshot["block_size"]
    return {
        "load": committed,
        "num_reqs": snapshot["in_flight"],
        "num_waiting_reqs": snapshot["queue_depth"],
        "num_tokens": committed,
        **capacity(snapshot, wait),
    }


def _engine(request: Request) -> ServingEngine:
    return request.app.state.helexa.engine


async def get_load(request: Request) -> Response:
    """`GET /get_load`: this replica's load from admission's exact numbers (see the module docstring)."""
    engine = _engine(request)
    return JSONResponse(load(engine.snapshot(), median_wait(engine)))


async def get_capacity(request: Request) -> Response:
    """`GET /v1/capacity`: how many more tokens this replica admits now, and the wait a median request costs."""
    engine = _engine(request)
    return JSONResponse(capacity(engine.snapshot(), median_wait(engine)))


def _model_info(engine: ServingEngine) -> dict[str, Any]:
    """SGLang's `/get_model_info` body for the served model."""
    return {
        "model_path": engine.model_name,
        "tokenizer_path": engine.model_name,
        "served_model_name": engine.model_name,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "architectures": [engine.model_config.architecture],
        "max_model_len": engine.max_model_len,
    }


async def get_model_info(request: Request) -> Response:
    """`GET /get_model_info`, `GET /model_info` (SGLang's): the served model."""
    return JSONResponse(_model_info(_engine(request)))


async def get_server_info(request: Request) -> Response:
    """`GET /get_server_info` (SGLang's): the model, the pool's shape, the limits, and the load as
    `internal_states`."""
    engine = _engine(request)
    snapshot = engine.snapshot()
    cfg = engine.config
    return JSONResponse(
        {
            "version": __version__,
            "model_path": engine.model_name,
            "tokenizer_path": engine.model_name,
            "served_model_name": engine.model_name,
            "context_length": engine.max_model_len,
            "page_size": snapshot["block_size"],
            "block_size": snapshot["block_size"],
            "max_total_num_tokens": snapshot["blocks_total"] * snapshot["block_size"],
            "max_running_requests": snapshot["max_in_flight"],
            "max_queued_requests": snapshot["max_queue_depth"],
            "chunked_prefill_size": cfg.max_num_batched_tokens,
            "disable_radix_cache": not cfg.prefix_cache,
            "dp_size": 1,
            "tp_size": cfg.tensor_parallel_size,
            "internal_states": [{"dp_rank": 0, **load(snapshot, median_wait(engine))}],
        }
    )


async def server_info(request: Request) -> Response:
    """`GET /server_info` (vLLM's): `{"vllm_config": ...}`, an object with `?config_format=json`, else the same
    object as a JSON string; the fields a router reads (`model_config.model`, `cache_config.block_size`)
    are where vLLM puts them."""
    engine = _engine(request)
    cfg = engine.config
    snapshot = engine.snapshot()
    config = {
        "model_config": {
            "model": engine.model_name,
            "served_model_name": engine.model_name,
            "tokenizer": engine.model_name,
            "max_model_len": engine.max_model_len,
        },
        "cache_config": {
            "block_size": snapshot["block_size"],
            "num_gpu_blocks": snapshot["blocks_total"],
            "enable_prefix_caching": cfg.prefix_cache,
        },
        "scheduler_config": {
            "max_num_seqs": snapshot["max_in_flight"],
            "max_num_batched_tokens": cfg.max_num_batched_tokens,
        },
        "parallel_config": {"tensor_parallel_size": cfg.tensor_parallel_size, "data_parallel_size": 1},
        "kv_events_config": {
            "enable_kv_cache_events": cfg.kv_events_endpoint is not None,
            "publisher": "zmq" if cfg.kv_events_endpoint is not None else "null",
            "endpoint": cfg.kv_events_endpoint,
            "replay_endpoint": cfg.kv_events_replay_endpoint,
            "topic": cfg.kv_events_topic or "",
        },
    }
    as_json = request.query_params.get("config_format", "text") == "json"
    return JSONResponse({"vllm_config": config if as_json else json.dumps(config)})


async def flush_cache(request: Request) -> Response:
    """`POST /flush_cache` (SGLang's): evict every cached prefix block no request holds, and every tier block; 200
    with how many pool blocks.

    Safe while requests run: a block some request holds (running, preempted and pinned, or held back) is
    never evicted, so no request loses its KV or its place. 503 `model_reloading` while no pool is loaded.
    """
    state = request.app.state.helexa
    engine: ServingEngine = state.engine
    if engine.health.state != "loaded":
        raise APIError(
            "model_reloading",
            f"the model is {engine.health.state}: no prefix cache to flush",
            status=503,
            error_type="service_unavailable_error",
        )
    try:
        evicted = await run_in_threadpool(engine.flush_prefix_cache)
    except TimeoutError:
        raise APIError("overloaded", "the engine did not reach a step boundary within 10 s; nothing flushed") from None
    return PlainTextResponse(f"Cache flushed: {evicted} cached blocks evicted; blocks in use were kept.\n")


def backend_routes() -> list[Route]:
    """The routes above, for `create_app`."""
    return [
        Route("/get_load", get_load, methods=["GET"]),
        Route("/v1/capacity", get_capacity, methods=["GET"]),
        Route("/server_info", server_info, methods=["GET"]),
        Route("/get_server_info", get_server_info, methods=["GET"]),
        Route("/get_model_info", get_model_info, methods=["GET"]),
        Route("/model_info", get_model_info, methods=["GET"]),
        Route("/flush_cache", flush_cache, methods=["POST"]),
    ]
