"""Load a Hugging Face style directory (config.json + safetensors) into a `CausalLM`: built on the
`meta` device, each parameter allocated once in the target dtype and device and filled from
memory-mapped safetensors, then attached with `load_state_dict(assign=True)`. Pickles are never read.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from helexa.kernels import AttentionBackend
from helexa.model.config import DTYPES, ModelConfig
from helexa.model.transformer import CausalLM, MergedLinear, copy_checked

__all__ = ["load_model", "resolve_dtype", "safetensors_files"]

log = logging.getLogger(__name__)


def resolve_dtype(
    dtype: str | torch.dtype, device: str | torch.device, config_dtype: torch.dtype | None = None
) -> torch.dtype:
    """The activation/weight dtype for `--dtype NAME` on `device`: "float32", "bfloat16", "float16" (or
    such a torch dtype) as given; "auto": float32 on CPU, on CUDA the checkpoint's half-precision dtype
    if it has one, else bfloat16 (float16 without bfloat16 support). `ValueError` for anything else."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; expected one of {sorted(DTYPES)}")
        return dtype
    if dtype in DTYPES:
        return DTYPES[dtype]
    if dtype != "auto":
        raise ValueError(f"unknown dtype {dtype!r}; expected 'auto' or one of {sorted(DTYPES)}")
    if torch.device(device).type != "cuda":
        return torch.float32
    bf16_ok = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return torch.float16 if config_dtype == torch.float16 or not bf16_ok else torch.bfloat16


def safetensors_files(path: str | Path) -> list[Path]:
    """The safetensors files of a model directory: those `model.safetensors.index.json` names (each
    must exist), else every `*.safetensors`. `ValueError` when there are none, naming any pickles."""
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


_Copy = Callable[[torch.Tensor, torch.Tensor], None]  # (parameter, checkpoint tensor)


def _checkpoint_targets(model: CausalLM) -> dict[str, tuple[str, _Copy]]:
    """Every checkpoint tensor name the model expects -> (its parameter's name, how to copy it in); a
    fused parameter takes one per stacked module (`qkv_proj.weight` <- `q_proj.weight`, `k_proj`...)."""
    targets: dict[str, tuple[str, _Copy]] = {}
    for param_name, _ in model.named_parameters():
        module_name, _, leaf = param_name.rpartition(".")
        module = model.get_submodule(module_name)
        if not isinstance(module, MergedLinear):
            targets[param_name] = (param_name, copy_checked)
            continue
        parent, _, local = module_name.rpartition(".")
        for shard_id, ckpt_module in enumerate(model.packed_modules[local]):
            targets[f"{parent}.{ckpt_module}.{leaf}"] = (
                param_name,
                functools.partial(module.weight_loader, shard_id=shard_id),
            )
    return targets


def load_model(
    path: str | Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    attention_backend: str | AttentionBackend = "auto",
) -> CausalLM:
    """The model in directory `path` on `device` in `dtype` (see `resolve_dtype`), in eval mode without
    gradients. Every parameter is filled exactly once from a safetensors tensor of its shape (a tied
    `lm_head.weight` may be absent, and is ignored if present); `ValueError` names the tensor that is
    missing, unexpected, duplicated or misshaped."""
    start = time.perf_counter()
    path = Path(path)
    config = ModelConfig.from_pretrained(path)
    device = torch.device(device)
    dtype = resolve_dtype(dtype, device, config.dtype)
    files = safetensors_files(path)

    with torch.device("meta"):
        model = CausalLM(config, attention_backend)
    targets = _checkpoint_targets(model)
    state = {name: torch.empty(p.shape, dtype=dtype, device=device) for name, p in model.named_parameters()}
    loaded: set[str] = set()
    num_bytes = 0
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                if name not in targets:
                    tied_head = config.tie_word_embeddings and name == "lm_head.weight"  # the embedding table
                    if tied_head or name.endswith("rotary_emb.inv_freq"):  # older exports saved RoPE frequencies
                        continue
                    raise ValueError(f"unexpected tensor {name!r} in {file.name} (not part of {config.architecture})")
                if name in loaded:
                    raise ValueError(f"tensor {name!r} appears more than once in the checkpoint (again in {file.name})")
                tensor = handle.get_tensor(name)
                param_name, copy = targets[name]
                try:
                    copy(state[param_name], tensor)
                except ValueError as exc:
                    raise ValueError(f"tensor {name!r} in {file.name}: {exc}") from exc
                loaded.add(name)
                num_bytes += tensor.numel() * tensor.element_size()

    missing = sorted(set(targets) - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (f" (and {len(missing) - 8} more)" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint in {path} is missing {len(missing)} tensor(s): {shown}")
    model.load_state_dict(state, strict=True, assign=True)
    model.reset_buffers(device)
    model.requires_grad_(False).eval()
    log.info(
        f"model: loaded {path} arch={config.architecture} params={config.num_parameters} "
        f"dtype={str(dtype).removeprefix('torch.')} device={device} files={len(files)} "
        f"read={num_bytes / 2**20:.1f}MiB in {time.perf_counter() - start:.2f}s"
    )
    return model
