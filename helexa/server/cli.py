"""`python -m helexa.server` flags (SPEC.md's, plus the engine's tuning knobs) → `EngineConfig` + `ServerSettings`."""

from __future__ import annotations

import argparse
import os

from helexa.engine.config import EngineConfig
from helexa.kvcache.budget import parse_size
from helexa.server.middleware import DEFAULT_MAX_BODY_BYTES
from helexa.server.settings import DEFAULT_SHUTDOWN_GRACE_SECS, ServerSettings

__all__ = ["build_parser", "configs_from_args"]

_DEFAULTS = EngineConfig()


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds >= 0, got {text!r}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `python -m helexa.server`; every flag is optional."""
    p = argparse.ArgumentParser(
        prog="python -m helexa.server",
        description="Serve a model over an OpenAI-compatible HTTP API with block-exact KV admission.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("model and placement")
    g.add_argument("--model", default=None, metavar="PATH|NAME",
                   help="a Hugging Face style directory or a known model name (default: SmolLM2-135M-Instruct)")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    g.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto")
    g.add_argument("--attention-backend", choices=("auto", "triton", "torch"), default="auto")

    g = p.add_argument_group("KV budget", "give at most one of --num-blocks, --kv-cache-memory, --gpu-memory-utilization")
    g.add_argument("--block-size", type=_positive_int, default=_DEFAULTS.block_size, help="tokens per KV block")
    budget = g.add_mutually_exclusive_group()
    budget.add_argument("--num-blocks", type=_positive_int, default=None, help="an exact KV block count")
    budget.add_argument("--kv-cache-memory", type=_size, default=None, metavar="SIZE",
                        help="KV pool size in bytes, e.g. 512MiB, 2GiB")
    budget.add_argument("--gpu-memory-utilization", type=_fraction, default=None, metavar="F",
                        help="fraction of device memory for weights, activations and KV (CUDA)")

    g = p.add_argument_group("scheduling and admission")
    g.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="longest sequence (prompt + output) accepted (default: the model's)")
    g.add_argument("--max-num-seqs", type=_positive_int, default=_DEFAULTS.max_num_seqs,
                   help="most sequences in flight at once")
    g.add_argument("--max-num-batched-tokens", type=_positive_int, default=_DEFAULTS.max_num_batched_tokens,
                   help="most tokens one engine step runs (decode tokens and prefill chunks)")
    g.add_argument("--max-queue-depth", type=_non_negative_int, default=_DEFAULTS.max_queue_depth,
                   help="most requests waiting for admission")
    g.add_argument("--max-wait-secs", type=_seconds, default=_DEFAULTS.max_wait_secs,
                   help="longest a request may wait for admission")
    g.add_argument("--default-max-tokens", type=_positive_int, default=_DEFAULTS.default_max_tokens,
                   help="output tokens reserved for a request that gives no max_tokens")
    g.add_argument("--admission-policy", choices=("fifo", "backfill"), default=_DEFAULTS.admission_policy)
    g.add_argument("--seed", type=int, default=_DEFAULTS.seed, help="the engine's seed for unseeded sampling")

    g = p.add_argument_group("device faults", "after a fault the engine reloads the model and replays "
                             "in-flight requests; past the retries it stays poisoned and answers 500 device_fault")
    g.add_argument("--max-fault-retries", type=_non_negative_int, default=_DEFAULTS.max_fault_retries,
                   help="consecutive device faults the engine recovers from before it gives up")
    g.add_argument("--fault-backoff-secs", type=_seconds, default=_DEFAULTS.fault_backoff_secs,
                   help="wait before the n-th consecutive reload: this x 2^(n-1) seconds")

    g = p.add_argument_group("HTTP server")
    g.add_argument("--host", default="127.0.0.1", help="bind address")
    g.add_argument("--port", type=int, default=8000, help="bind port (0: any free port)")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* "
                   "(default: $HELEXA_API_KEY; the key is never printed)")
    g.add_argument("--max-body-size", type=_size, default=DEFAULT_MAX_BODY_BYTES, metavar="SIZE",
                   help="largest request body accepted (413 beyond), e.g. 8MiB")
    g.add_argument("--shutdown-grace-secs", type=_seconds, default=DEFAULT_SHUTDOWN_GRACE_SECS,
                   help="on SIGTERM/SIGINT, how long in-flight requests may finish before they are aborted")
    g.add_argument("--log-level", choices=("critical", "error", "warning", "info", "debug"), default="info")
    return p


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, ServerSettings]:
    """The engine config and server settings the parsed flags describe (raises ValueError for bad combinations)."""
    engine = EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_queue_depth=args.max_queue_depth,
        max_wait_secs=args.max_wait_secs,
        default_max_tokens=args.default_max_tokens,
        attention_backend=args.attention_backend,
        admission_policy=args.admission_policy,
        seed=args.seed,
        max_fault_retries=args.max_fault_retries,
        fault_backoff_secs=args.fault_backoff_secs,
    )
    settings = ServerSettings(
        host=args.host,
        port=args.port,
        api_key=args.api_key or os.environ.get("HELEXA_API_KEY") or None,
        max_body_bytes=args.max_body_size,
        shutdown_grace_secs=args.shutdown_grace_secs,
        log_level=args.log_level,
    )
    return engine, settings
