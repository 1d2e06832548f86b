"""The KV budget: the pool's block count, derived from totals so every load gives the same number.

Never from a live free-memory reading (`torch.cuda.mem_get_info`), which the caching allocator and
other ranks move, so the budget would shrink after a reload and differ between tensor-parallel ranks:

- CUDA: `available = total_device_memory * gpu_memory_utilization - weight_bytes - activation_reserve_bytes`,
  `num_blocks = available // bytes_per_block`, unless `num_blocks` or `kv_cache_memory` asks for a
  smaller exact size (a larger one is an error).
- CPU (any non-CUDA device): `available = physical RAM - weight_bytes - activation_reserve_bytes`; the
  pool gets `kv_cache_memory` bytes or `num_blocks` blocks when given, else
  `min(CPU_DEFAULT_FRACTION * physical RAM, CPU_DEFAULT_CAP)`, never more than `available`.

The activation reserve (`estimate_activation_bytes`, or a measured peak) is the caller's number.

An fp8 pool (`dtype=torch.float8_e4m3fn`, `--kv-cache-dtype fp8`) counts one byte per element, so
the same `kv_cache_memory` holds exactly 4x the blocks of float32 and 2x those of bfloat16. Its
float32 scales (`kv_scale_bytes`: one per layer, KV head, K and V, not per block) come off
`available` like the weights, so they never change a requested pool's block count.
"""

from __future__ import annotations

import os

import torch

from helexa.kernels import FP8_KV_DTYPE
from helexa.kvcache.budget_record import KVBudget, format_bytes
from helexa.values import check_int, parse_size

__all__ = ["CPU_DEFAULT_CAP", "CPU_DEFAULT_FRACTION", "DEFAULT_GPU_MEMORY_UTILIZATION", "KVBudget",
           "estimate_activation_bytes", "kv_budget", "kv_bytes_per_block", "kv_scale_bytes"]  # fmt: skip

CPU_DEFAULT_FRACTION = 0.10  # of physical RAM, when neither --num-blocks nor --kv-cache-memory is given
CPU_DEFAULT_CAP = 4 << 30  # 4 GiB: a CPU pool larger than this is rarely what a laptop user meant
DEFAULT_GPU_MEMORY_UTILIZATION = 0.90
ACTIVATION_SAFETY_FACTOR = 2  # estimate x2: allocator fragmentation, kernel workspaces, temporaries


def _itemsize(dtype: torch.dtype) -> int:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    return dtype.itemsize


def kv_bytes_per_block(block_size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one block takes over all layers, K and V: `2 * L * BS * KVH * D * itemsize`."""
    return (
        2
        * check_int(num_layers, "num_layers")
        * check_int(block_size, "block_size")
        * check_int(num_kv_heads, "num_kv_heads")
        * check_int(head_dim, "head_dim")
        * _itemsize(dtype)
    )


def kv_scale_bytes(num_layers: int, num_kv_heads: int, dtype: torch.dtype) -> int:
    """Bytes of an fp8 pool's scales: `2 * L * KVH * 4` (float32 k_scale and v_scale per layer and KV
    head); 0 for a pool of any other dtype."""
    if dtype != FP8_KV_DTYPE:
        return 0
    return 2 * check_int(num_layers, "num_layers") * check_int(num_kv_heads, "num_kv_heads") * 4


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
    """Peak activation bytes of one forward over T = `max_num_batched_tokens` tokens, a function of the
    shapes only: the tensors alive together in one decoder layer (residual, normed input and output
    `3*T*hidden`; q/k/v `T*(H+2*KVH)*D`; attention output `T*H*D`; gate, up and activation
    `3*T*intermediate`) in `dtype`, plus fp32 logits and probabilities of `min(max_num_seqs, T)` rows,
    all times `ACTIVATION_SAFETY_FACTOR`."""
    shapes = dict(hidden_size=hidden_size, intermediate_size=intermediate_size, num_heads=num_heads,
                  num_kv_heads=num_kv_heads, head_dim=head_dim, vocab_size=vocab_size,
                  max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs)  # fmt: skip
    for name, value in shapes.items():
        check_int(value, name)
    tokens = max_num_batched_tokens
    per_token = 3 * hidden_size + (2 * num_heads + 2 * num_kv_heads) * head_dim + 3 * intermediate_size
    logits = 2 * min(max_num_seqs, tokens) * vocab_size * 4
    return ACTIVATION_SAFETY_FACTOR * (tokens * per_token * _itemsize(dtype) + logits)


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
    memory_share: int = 1,
) -> KVBudget:
    """The pool's block count from totals (see the module docstring): same inputs, same answer.

    At most one of `num_blocks` / `kv_cache_memory` (bytes or a size string) asks for an exact size;
    `gpu_memory_utilization` in (0, 1] sets the CUDA ceiling (default 0.90) and is an error elsewhere;
    `total_memory_bytes` overrides the device total (CUDA `total_memory`, or physical RAM).
    `memory_share`: processes that budget from the same host RAM (tensor-parallel ranks on a CPU):
    each takes `physical RAM / memory_share` as its total (ignored on CUDA and with
    `total_memory_bytes`, which are already one rank's). Raises
    `ValueError` naming the numbers and the flag to change when the result would be zero blocks or
    over the budget. `dtype` is the cache's: `torch.float8_e4m3fn` for an fp8 pool (one byte per
    element; its scales come off `available`).
    """
    dev = torch.device(device)
    bytes_per_block = kv_bytes_per_block(block_size, num_layers, num_kv_heads, head_dim, dtype)
    scale_bytes = kv_scale_bytes(num_layers, num_kv_heads, dtype)
    weight_bytes = check_int(weight_bytes, "weight_bytes", 0)
    activation_reserve_bytes = check_int(activation_reserve_bytes, "activation_reserve_bytes", 0)
    if num_blocks is not None and kv_cache_memory is not None:
        raise ValueError("give either --num-blocks or --kv-cache-memory, not both")
    if num_blocks is not None:
        check_int(num_blocks, "num_blocks", 0)
    kv_bytes = parse_size(kv_cache_memory) if kv_cache_memory is not None else None

    on_cuda = dev.type == "cuda"
    if gpu_memory_utilization is not None:
        if not on_cuda:
            raise ValueError(f"--gpu-memory-utilization applies to CUDA devices, not {dev.type}; use --kv-cache-memory")
        if isinstance(gpu_memory_utilization, bool) or not 0 < float(gpu_memory_utilization) <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization!r}")
    utilization = float(gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION) if on_cuda else 1.0
    if total_memory_bytes is None:
        total = _cuda_total_memory(dev) if on_cuda else _physical_memory() // check_int(memory_share, "memory_share")
    else:
        total = check_int(total_memory_bytes, "total_memory_bytes")
    available = int(total * utilization) - weight_bytes - activation_reserve_bytes - scale_bytes

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

    budget = KVBudget(dev.type, source, count, block_size, bytes_per_block, total, utilization, weight_bytes,
                      activation_reserve_bytes, available, requested, scale_bytes)  # fmt: skip
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
            f"KV cache of {count} blocks ({format_bytes(requested)}) exceeds the budget of {budget.max_blocks} blocks "
            f"({format_bytes(available)} available; {budget.describe()}); {flag} or {fix}"
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
        raise ValueError(
            "cannot read physical memory on this platform; pass --kv-cache-memory or --num-blocks"
        ) from None
