"""The KV budget: how many blocks the pool gets, derived from totals so every load gives the same number.

Never from a live free-memory reading (`torch.cuda.mem_get_info`, driver "free"): the caching
allocator and other ranks move that number, so a budget taken from it shrinks after a reload and
differs between tensor-parallel ranks. Here:

- CUDA: `available = total_device_memory * gpu_memory_utilization - weight_bytes - activation_reserve_bytes`
  and `num_blocks = floor(available / bytes_per_block)`, unless `num_blocks` or
  `kv_cache_memory` asks for a smaller exact size (a larger one is an error).
- CPU (and any non-CUDA device): `available = physical RAM - weight_bytes - activation_reserve_bytes`;
  the pool gets `kv_cache_memory` bytes or `num_blocks` blocks when given, else
  `min(CPU_DEFAULT_FRACTION * physical RAM, CPU_DEFAULT_CAP)`, never more than `available`.

The activation reserve comes from the model's shapes and the largest batch the engine runs
(`estimate_activation_bytes`) or from a measured peak; the caller passes the number.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

__all__ = [
    "KVBudget",
    "kv_budget",
    "parse_size",
    "estimate_activation_bytes",
    "kv_bytes_per_block",
    "CPU_DEFAULT_FRACTION",
    "CPU_DEFAULT_CAP",
    "DEFAULT_GPU_MEMORY_UTILIZATION",
]

CPU_DEFAULT_FRACTION = 0.10  # of physical RAM, when neither --num-blocks nor --kv-cache-memory is given
CPU_DEFAULT_CAP = 4 << 30  # 4 GiB: a CPU pool larger than this is rarely what a laptop user meant
DEFAULT_GPU_MEMORY_UTILIZATION = 0.90
ACTIVATION_SAFETY_FACTOR = 2  # estimate x2: allocator fragmentation, kernel workspaces, temporaries

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}  # fmt: skip
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes in a size such as "512MiB", "2GiB", "1.5G", "4096" (an int is returned as is).

    KiB/MiB/GiB/TiB and bare K/M/G/T are powers of 1024; KB/MB/GB/TB powers of 1000; case is
    ignored. Raises `ValueError` for anything else or a size below one byte.
    """
    if isinstance(text, bool):
        raise ValueError(f"not a size: {text!r}")
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE_RE.match(str(text))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"not a size: {text!r} (expected e.g. 512MiB, 2GiB, 1.5G, 4096)")
        value = int(float(match.group(1)) * _UNITS[unit])
    if value < 1:
        raise ValueError(f"size must be at least 1 byte, got {text!r}")
    return value


def _fmt(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 30):.2f}GiB" if abs(num_bytes) >= 1 << 30 else f"{num_bytes / (1 << 20):.1f}MiB"


def _itemsize(dtype: torch.dtype) -> int:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    return torch.empty((), dtype=dtype).element_size()


def _positive(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _non_negative(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


def kv_bytes_per_block(
    block_size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one block takes over all layers, K and V: `2 * L * BS * KVH * D * itemsize`."""
    return (
        2
        * _positive(num_layers, "num_layers")
        * _positive(block_size, "block_size")
        * _positive(num_kv_heads, "num_kv_heads")
        * _positive(head_dim, "head_dim")
        * _itemsize(dtype)
    )


def estimate_activation_bytes(
    *,
    hidden_size: int,
    intermediate_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    vocab_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    dtype: torch.dtype,
) -> int:
    """Peak activation memory of one forward over `max_num_batched_tokens` tokens, times a safety factor.

    Counts, for T tokens, the tensors alive together in one decoder layer (residual, normed
    input and output `3*T*hidden`; q/k/v `T*(H+2*KVH)*D`; attention output `T*H*D`; gate, up and
    activation `3*T*intermediate`) in `dtype`, plus float32 logits and probabilities for
    `max_num_seqs` rows (`2*S*vocab*4`), all times `ACTIVATION_SAFETY_FACTOR`. Deterministic:
    a function of the shapes only.
    """
    tokens = _positive(max_num_batched_tokens, "max_num_batched_tokens")
    rows = _positive(max_num_seqs, "max_num_seqs")
    itemsize = _itemsize(dtype)
    per_token = (
        3 * _positive(hidden_size, "hidden_size")
        + (_positive(num_heads, "num_heads") + 2 * _positive(num_kv_heads, "num_kv_heads")) * _positive(head_dim, "head_dim")
        + num_heads * head_dim
        + 3 * _positive(intermediate_size, "intermediate_size")
    )
    logits = 2 * min(rows, tokens) * _positive(vocab_size, "vocab_size") * 4
    return ACTIVATION_SAFETY_FACTOR * (tokens * per_token * itemsize + logits)


@dataclass(frozen=True)
class KVBudget:
    """The block count of a KV pool and every number that produced it (log it with `describe()`).

    `source` says what decided the size: "num_blocks" (--num-blocks), "kv_cache_memory"
    (--kv-cache-memory), "gpu_memory_utilization" (the CUDA budget) or "cpu_default" (the CPU
    default fraction of RAM). `available_bytes` is the most the pool may take:
    `total_memory_bytes * memory_utilization - weight_bytes - activation_reserve_bytes`.
    """

    device_type: str
    source: str
    num_blocks: int
    block_size: int
    bytes_per_block: int
    total_memory_bytes: int
    memory_utilization: float
    weight_bytes: int
    activation_reserve_bytes: int
    available_bytes: int
    requested_bytes: int

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes the pool takes: `num_blocks * bytes_per_block`."""
        return self.num_blocks * self.bytes_per_block

    @property
    def num_tokens(self) -> int:
        """Tokens the pool holds: `num_blocks * block_size`."""
        return self.num_blocks * self.block_size

    @property
    def max_blocks(self) -> int:
        """The most blocks `available_bytes` allows."""
        return max(0, self.available_bytes) // self.bytes_per_block

    def describe(self) -> str:
        """One log line with the arithmetic, e.g.
        `kv budget: cuda total=80.00GiB x 0.90 - weights=15.00GiB - activations=1.20GiB = 55.80GiB available;
        gpu_memory_utilization -> 55.80GiB / 131072 B/block (16 tokens) = 457113 blocks (7313808 tokens, 55.80GiB)`.
        """
        return (
            f"kv budget: {self.device_type} total={_fmt(self.total_memory_bytes)} x {self.memory_utilization:.2f}"
            f" - weights={_fmt(self.weight_bytes)} - activations={_fmt(self.activation_reserve_bytes)}"
            f" = {_fmt(self.available_bytes)} available; {self.source} -> {_fmt(self.requested_bytes)}"
            f" / {self.bytes_per_block} B/block ({self.block_size} tokens) = {self.num_blocks} blocks"
            f" ({self.num_tokens} tokens, {_fmt(self.kv_cache_bytes)})"
        )


def kv_budget(
    *,
    block_size: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    weight_bytes: int = 0,
    activation_reserve_bytes: int = 0,
    num_blocks: int | None = None,
    kv_cache_memory: int | str | None = None,
    gpu_memory_utilization: float | None = None,
    total_memory_bytes: int | None = None,
) -> KVBudget:
    """Decide the pool's block count from totals (see the module docstring); same inputs, same answer.

    `weight_bytes`: bytes of resident weights; `activation_reserve_bytes`: see
    `estimate_activation_bytes`. At most one of `num_blocks` / `kv_cache_memory` (bytes or a size
    string) asks for an exact size; `gpu_memory_utilization` (0, 1] sets the CUDA ceiling (default
    0.90) and is an error elsewhere. `total_memory_bytes` overrides the device total (the CUDA
    device's `total_memory`, or physical RAM) for planning and tests. Raises `ValueError` naming
    the numbers and the flag to change when the result would be zero blocks or more than the
    budget allows.
    """
    dev = torch.device(device)
    bytes_per_block = kv_bytes_per_block(block_size, num_layers, num_kv_heads, head_dim, dtype)
    weight_bytes = _non_negative(weight_bytes, "weight_bytes")
    activation_reserve_bytes = _non_negative(activation_reserve_bytes, "activation_reserve_bytes")
    if num_blocks is not None and kv_cache_memory is not None:
        raise ValueError("give either --num-blocks or --kv-cache-memory, not both")
    if num_blocks is not None:
        _non_negative(num_blocks, "num_blocks")
    kv_bytes = parse_size(kv_cache_memory) if kv_cache_memory is not None else None

    on_cuda = dev.type == "cuda"
    if gpu_memory_utilization is not None:
        if not on_cuda:
            raise ValueError(f"--gpu-memory-utilization applies to CUDA devices, not {dev.type}; use --kv-cache-memory")
        if isinstance(gpu_memory_utilization, bool) or not 0 < float(gpu_memory_utilization) <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization!r}")
    utilization = (
        float(gpu_memory_utilization if gpu_memory_utilization is not None else DEFAULT_GPU_MEMORY_UTILIZATION)
        if on_cuda
        else 1.0
    )
    if total_memory_bytes is None:
        total = _cuda_total_memory(dev) if on_cuda else _physical_memory()
    else:
        total = _positive(total_memory_bytes, "total_memory_bytes")
    available = int(total * utilization) - weight_bytes - activation_reserve_bytes

    if num_blocks is not None:
        source, requested = "num_blocks", num_blocks * bytes_per_block
    elif kv_bytes is not None:
        source, requested = "kv_cache_memory", kv_bytes
    elif on_cuda:
        source, requested = "gpu_memory_utilization", max(0, available)
    else:
        source = "cpu_default"
        requested = max(0, min(int(total * CPU_DEFAULT_FRACTION), CPU_DEFAULT_CAP, available))
    count = num_blocks if num_blocks is not None else requested // bytes_per_block

    budget = KVBudget(
        device_type=dev.type,
        source=source,
        num_blocks=count,
        block_size=block_size,
        bytes_per_block=bytes_per_block,
        total_memory_bytes=total,
        memory_utilization=utilization,
        weight_bytes=weight_bytes,
        activation_reserve_bytes=activation_reserve_bytes,
        available_bytes=available,
        requested_bytes=requested,
    )
    fix = "raise --gpu-memory-utilization" if on_cuda else "free host memory"
    if count == 0:
        ask = {
            "num_blocks": "set --num-blocks to at least 1",
            "kv_cache_memory": f"raise --kv-cache-memory to at least {bytes_per_block} bytes",
        }.get(source, f"{fix}, or use a smaller model, --block-size or --max-num-seqs")
        raise ValueError(f"KV budget is 0 blocks ({budget.describe()}); {ask}")
    if requested > available:
        flag = {"num_blocks": "lower --num-blocks", "kv_cache_memory": "lower --kv-cache-memory"}.get(source, fix)
        raise ValueError(
            f"KV cache of {count} blocks ({_fmt(requested)}) exceeds the budget of {budget.max_blocks} blocks "
            f"({_fmt(available)} available; {budget.describe()}); {flag} or {fix}"
        )
    return budget


def _cuda_total_memory(device: torch.device) -> int:
    """Total memory of a CUDA device (a fixed property of the card, not a free reading)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return int(torch.cuda.get_device_properties(index).total_memory)


def _physical_memory() -> int:
    """Physical RAM of this machine in bytes (fixed, not the currently free amount)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        raise ValueError("cannot read physical memory on this platform; pass --kv-cache-memory or --num-blocks") from None
