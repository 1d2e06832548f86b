"""Engine configuration: one frozen dataclass, validated once, shared by the offline API and the server."""

from __future__ import annotations

from dataclasses import dataclass

_BACKENDS = ("auto", "triton", "torch")
_DEVICES = ("auto", "cpu", "cuda")
_DTYPES = ("auto", "float32", "bfloat16", "float16")
_POLICIES = ("fifo", "backfill")


@dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes a loaded engine. The same config always gives the same KV block count.

    KV budget: exactly one of `num_blocks` (an exact count), `kv_cache_memory` (bytes) or
    `gpu_memory_utilization` (fraction of device memory, CUDA only) decides the pool size; with
    none given the budget's documented default for the device applies.
    `max_model_len=None` means the model's `max_position_embeddings`. `default_max_tokens` is the
    output budget reserved for a request that does not say `max_tokens` (bounded by what is left
    of `max_model_len` after the prompt).

    Device faults: the engine reloads and replays after a fault; after `max_fault_retries`
    consecutive faults (a fault during replay counts, a successful step resets the count) it stays
    poisoned. Reload attempts wait `fault_backoff_secs × 2^(n−1)` before the n-th consecutive one.
    """

    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_queue_depth: int = 1024
    max_wait_secs: float = 600.0
    default_max_tokens: int = 4096
    attention_backend: str = "auto"
    admission_policy: str = "fifo"
    seed: int = 0
    max_fault_retries: int = 3
    fault_backoff_secs: float = 0.5

    def __post_init__(self) -> None:
        _choice("device", self.device, _DEVICES)
        _choice("dtype", self.dtype, _DTYPES)
        _choice("attention_backend", self.attention_backend, _BACKENDS)
        _choice("admission_policy", self.admission_policy, _POLICIES)
        if self.block_size < 1 or self.block_size & (self.block_size - 1) or self.block_size > 128:
            raise ValueError(f"block_size must be a power of two in [1, 128], got {self.block_size}")
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("default_max_tokens", self.default_max_tokens)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}) so every running sequence can decode each step")
        if not isinstance(self.max_fault_retries, int) or self.max_fault_retries < 0:
            raise ValueError(f"max_fault_retries must be an int >= 0, got {self.max_fault_retries!r}")
        if not self.fault_backoff_secs >= 0:
            raise ValueError(f"fault_backoff_secs must be >= 0, got {self.fault_backoff_secs!r}")
        if self.max_queue_depth < 0:
            raise ValueError(f"max_queue_depth must be >= 0, got {self.max_queue_depth}")
        if not self.max_wait_secs > 0:
            raise ValueError(f"max_wait_secs must be > 0, got {self.max_wait_secs}")
        if self.num_blocks is not None:
            _positive("num_blocks", self.num_blocks)
        if self.kv_cache_memory is not None:
            _positive("kv_cache_memory", self.kv_cache_memory)
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        given = [n for n in ("num_blocks", "kv_cache_memory", "gpu_memory_utilization") if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValueError(f"give at most one KV budget (--num-blocks, --kv-cache-memory, "
                             f"--gpu-memory-utilization); got {', '.join(given)}")


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
