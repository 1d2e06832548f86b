"""Load a Hugging Face style directory (config.json + safetensors) into a `CausalLM`.

The model is built on the `meta` device (no memory, no init), each parameter is allocated once in
the target dtype and device, every checkpoint tensor is read through a memory map
(`safetensors.safe_open`) and handed to its layer's `weight_loader` hook, and the filled tensors
are attached with `load_state_dict(assign=True)`. Pickle-based weights (`.bin`, `.pt`) are never
read. Every expected tensor must be present exactly once, with its shape; anything else in the
checkpoint is an error naming it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from helexa.kernels import AttentionBackend
from helexa.model.config import ModelConfig
from helexa.model.transformer import CausalLM

__all__ = ["load_model", "resolve_dtype", "safetensors_files"]

log = logging.getLogger(__name__)

_DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Checkpoint tensors that carry no weights (older exports saved RoPE frequencies).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_dtype(
    dtype: str | torch.dtype, device: str | torch.device, config_dtype: torch.dtype | None = None
) -> torch.dtype:
    """The activation/weight dtype for `--dtype NAME` on `device`.

    "float32" | "bfloat16" | "float16" (or a torch dtype) are taken as given. "auto": float32 on
    CPU (exact, and fast without AMX); on CUDA the checkpoint's half-precision dtype when it has
    one, else bfloat16 — falling back to float16 where the GPU has no bfloat16.
    Raises `ValueError` for any other name.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPE_NAMES.values():
            raise ValueError(f"unsupported dtype {dtype}; expected one of {sorted(_DTYPE_NAMES)}")
        return dtype
    if dtype in _DTYPE_NAMES:
        return _DTYPE_NAMES[dtype]
    if dtype != "auto":
        raise ValueError(f"unknown dtype {dtype!r}; expected 'auto' or one of {sorted(_DTYPE_NAMES)}")
    device = torch.device(device)
    if device.type != "cuda":
        return torch.float32
    bf16_ok = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if config_dtype == torch.float16 or not bf16_ok:
        return torch.float16
    return torch.bfloat16


def safetensors_files(path: str | Path) -> list[Path]:
    """The safetensors files of a model directory, in load order.

    Sharded checkpoints are read from `model.safetensors.index.json` (every file it names must
    exist); otherwise every `*.safetensors` in the directory. Raises `ValueError` when there are
    none — naming any `.bin`/`.pt` files found, which helexa refuses to unpickle.
    """
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{index} is not a valid safetensors index: {exc}") from exc
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index.name} names shard files that do not exist: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    pickled = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth")) if path.is_dir() else []
    if pickled:
        raise ValueError(
            f"{path} has only pickle-format weights ({', '.join(pickled)}); helexa loads safetensors only "
            "(never unpickles). Convert with transformers: "
            "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out, safe_serialization=True)"
        )
    raise ValueError(f"no *.safetensors weights in {path}")


@dataclass(frozen=True)
class _Target:
    """Where one checkpoint tensor goes: a parameter (by state-dict name) and its layer's hook."""

    param_name: str
    module: nn.Module
    shard_id: Hashable


def _checkpoint_targets(model: CausalLM) -> dict[str, _Target]:
    """Every checkpoint tensor name the model expects -> where it loads.

    Fused parameters expand to one name per stacked checkpoint module
    (`...qkv_proj.weight` <- `...q_proj.weight` / `k_proj` / `v_proj`).
    """
    targets: dict[str, _Target] = {}
    for param_name, _ in model.named_parameters():
        module_name, _, leaf = param_name.rpartition(".")
        module = model.get_submodule(module_name)
        parent, _, local = module_name.rpartition(".")
        packed = model.packed_modules.get(local)
        if packed is None:
            targets[param_name] = _Target(param_name, module, None)
            continue
        for ckpt_module, shard_id in packed:
            targets[f"{parent}.{ckpt_module}.{leaf}"] = _Target(param_name, module, shard_id)
    return targets


def _iter_checkpoint(files: list[Path]) -> Iterator[tuple[str, Path, "safe_open"]]:
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, file, f


def load_model(
    path: str | Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    attention_backend: str | AttentionBackend = "auto",
) -> CausalLM:
    """Load the model in directory `path` onto `device` in `dtype` (see `resolve_dtype`).

    Guarantees: weights come only from safetensors (memory-mapped; `.bin`/`.pt` refused); every
    parameter is filled exactly once from a checkpoint tensor of the same shape, cast to `dtype`;
    a tied `lm_head.weight` may be absent (and is ignored if present). Raises `ValueError` naming
    the tensor for a missing, unexpected, duplicated or misshaped tensor. The model is in eval
    mode with `requires_grad=False` and its attention backend bound.
    """
    start = time.perf_counter()
    path = Path(path)
    config = ModelConfig.from_pretrained(path)
    device = torch.device(device)
    dtype = resolve_dtype(dtype, device, config.dtype)
    files = safetensors_files(path)

    with torch.device("meta"):
        model = CausalLM(config, attention_backend)
    targets = _checkpoint_targets(model)
    state = {
        name: torch.empty(p.shape, dtype=dtype, device=device) for name, p in model.named_parameters()
    }
    loaded: set[str] = set()
    num_bytes = 0
    for name, file, handle in _iter_checkpoint(files):
        target = targets.get(name)
        if target is None:
            if name.endswith(_IGNORED_SUFFIXES) or (config.tie_word_embeddings and name == "lm_head.weight"):
                continue
            raise ValueError(f"unexpected tensor {name!r} in {file.name} (not part of {config.architecture})")
        if name in loaded:
            raise ValueError(f"tensor {name!r} appears more than once in the checkpoint (again in {file.name})")
        tensor = handle.get_tensor(name)
        try:
            target.module.weight_loader(state[target.param_name], tensor, target.shard_id)
        except ValueError as exc:
            raise ValueError(f"tensor {name!r} in {file.name}: {exc}") from exc
        loaded.add(name)
        num_bytes += tensor.numel() * tensor.element_size()

    missing = sorted(set(targets) - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (f" (and {len(missing) - 8} more)" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint in {path} is missing {len(missing)} tensor(s): {shown}")

    model.load_state_dict(state, strict=True, assign=True)
    model.rotary_emb.reset_buffers(device)
    model.requires_grad_(False)
    model.eval()
    elapsed = time.perf_counter() - start
    log.info(
        "model: loaded %s arch=%s params=%d dtype=%s device=%s files=%d read=%.1fMiB in %.2fs",
        path, config.architecture, config.num_parameters, str(dtype).removeprefix("torch."), device,
        len(files), num_bytes / 2**20, elapsed,
    )
    return model
