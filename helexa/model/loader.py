"""Load a Hugging Face style directory (config.json + safetensors) into a `CausalLM`: built on the
`meta` device, each parameter allocated once in the target dtype and device and filled from the
safetensors files by positioned reads (`weights.tensor_file`: never mapped, so the file's pages are
not this process's memory), then attached with `load_state_dict(assign=True)`. Pickles are never read.

Tensors are read module by module; on the CPU a quantized module whose every part is read is
prepared at once, so its kernel's tiled layout replaces the read tensors before the next module is
read: peak memory while loading is about the weights' resident size, not twice it.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import time
import zlib
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from helexa.kernels import AttentionBackend
from helexa.model.config import DTYPE_NAMES, ModelConfig
from helexa.model.parallel.comm import TensorParallel
from helexa.model.quant import hugepages, native
from helexa.model.quant.apply import (
    QUANTIZATION_CHOICES,
    checkpoint_modules,
    decoder_linears,
    install_quantized,
    quantize_decoder,
    quantized_modules,
)
from helexa.model.quant.linear import QuantEmbedding, QuantLinear
from helexa.model.quant.native_step import native_step_for
from helexa.model.quant.weight import SUFFIXES, QuantizedWeight
from helexa.model.transformer import CausalLM, copy_checked
from helexa.model.weights.tensor_file import TensorFile

__all__ = ["load_model", "resolve_dtype", "safetensors_files"]

log = logging.getLogger(__name__)


DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}  # the dtypes helexa runs, by name


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device, config_dtype: str | None = None) -> torch.dtype:
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
    return torch.float16 if config_dtype == "float16" or not bf16_ok else torch.bfloat16


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


def _rows(offset: int, rows: int) -> _Copy:
    """Copy into rows [offset, offset + rows) of the destination (a stacked shard)."""
    return lambda dst, src: copy_checked(dst.narrow(0, offset, rows), src)


def _checkpoint_targets(model: CausalLM) -> dict[str, tuple[str, _Copy]]:
    """Every checkpoint tensor name the model expects -> (its state-dict entry, how to copy it in); a
    fused parameter takes one per stacked module (`qkv_proj.weight` <- `q_proj.weight`, `k_proj`...),
    a quantized module's buffers one per part (`q_proj.qweight`, `.scales`, `.zeros`) and stacked module."""
    targets: dict[str, tuple[str, _Copy]] = {}
    quant_parts = [n for n, b in model.named_buffers() if b is not None and _is_quant_part(n)]
    for state_name in [name for name, _ in model.named_parameters()] + quant_parts:
        module_name, _, leaf = state_name.rpartition(".")
        owner = module_name.removesuffix(".head")  # a QuantEmbedding keeps its table in `head`
        if owner == module_name or not isinstance(model.get_submodule(owner), QuantEmbedding):
            owner = module_name
        ckpt_modules = checkpoint_modules(model, owner)
        if len(ckpt_modules) == 1:
            targets[f"{ckpt_modules[0]}.{leaf}"] = (state_name, copy_checked)
            continue
        sizes = _shard_rows(model, owner)
        for shard_id, ckpt_module in enumerate(ckpt_modules):
            targets[f"{ckpt_module}.{leaf}"] = (state_name, _rows(sum(sizes[:shard_id]), sizes[shard_id]))
    return targets


def _shard_rows(model: CausalLM, module_name: str) -> tuple[int, ...]:
    """Rows of each stacked checkpoint module in the fused module `module_name` (this rank's, under
    tensor parallelism)."""
    parent, _, local = module_name.rpartition(".")
    plan = model.plan
    if local == "qkv_proj":
        return (plan.q_size, plan.kv_size, plan.kv_size)
    half = plan.intermediate_size  # gate|up
    return (half, half)


def _narrow(tensor: torch.Tensor, part: tuple[int, int, int] | None) -> torch.Tensor:
    """The `(dim, start, stop)` slice of an in-memory tensor (None: all of it)."""
    if part is None:
        return tensor
    dim, start, stop = part
    return tensor.narrow(dim, start, stop - start)


class _Layout(NamedTuple):
    """How a checkpoint module is stored quantized."""

    kind: str  # "int8" or "int4"
    k: int  # input features
    group: int  # K for per-channel scales
    scale_dtype: torch.dtype


def _quantized_layout(shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]], module: str) -> _Layout | None:
    """The layout of checkpoint module `module` if it is stored quantized, else None."""
    if f"{module}.qweight" not in shapes:
        return None
    q_dtype, q_shape = shapes[f"{module}.qweight"]
    s_dtype, s_shape = shapes.get(f"{module}.scales", (torch.float32, ()))
    k = q_shape[1] * (2 if q_dtype == torch.uint8 else 1)
    group = k if len(s_shape) == 1 else k // max(1, s_shape[1]) if len(s_shape) == 2 else 0
    return _Layout("int4" if q_dtype == torch.uint8 else "int8", k, group, s_dtype)


def _install_checkpoint_quantization(
    model: CausalLM, shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]], dtype: torch.dtype
) -> list[str]:
    """Swap in a quantized module (on meta) for every module whose checkpoint modules are all stored
    quantized in one layout; returns the names of modules left dense although some of their
    checkpoint modules are quantized (mixed layouts: dequantised at load)."""
    mixed = []
    names = ["model.embed_tokens", *decoder_linears(model), *(["lm_head"] if model.lm_head is not None else [])]
    for name in names:
        layouts = {_quantized_layout(shapes, m) for m in checkpoint_modules(model, name)}
        if layouts == {None}:
            continue
        if len(layouts) != 1:
            mixed.append(name)
            continue
        layout = layouts.pop()
        assert layout is not None
        kind, k, group, scale_dtype = layout
        module = model.get_submodule(name)
        assert isinstance(module, nn.Embedding | nn.Linear)
        n = module.num_embeddings if isinstance(module, nn.Embedding) else module.out_features
        with torch.device("meta"):
            qweight = torch.empty(
                n, k if kind == "int8" else k // 2, dtype=torch.int8 if kind == "int8" else torch.uint8
            )
            groups = () if group == k and kind == "int8" else (k // group,)
            scales = torch.empty(n, *groups, dtype=scale_dtype)
            zeros = torch.empty(n, *groups, dtype=scale_dtype) if kind == "int4" else None
        install_quantized(model, name, QuantizedWeight.of(qweight, scales, zeros), dtype)
    return mixed


def _tensor_shapes(files: list[Path]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """name -> (dtype, shape) of every tensor of the checkpoint, from the headers; `ValueError` for a
    name two files hold."""
    shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for path in files:
        with TensorFile(path) as file:
            for name, info in file.infos.items():
                if name in shapes:
                    raise ValueError(f"tensor {name!r} appears more than once in the checkpoint (again in {path.name})")
                shapes[name] = (info.dtype, info.shape)
    return shapes


def _reading_order(
    files: list[TensorFile], targets: dict[str, tuple[str, _Copy]], model: CausalLM
) -> list[tuple[str, TensorFile]]:
    """Every checkpoint tensor with its file, grouped by the model module it fills (in the model's
    module order; a fused module's stacked parts together), so that each quantized module is complete,
    and can be prepared, before the next one is read. Tensors the model does not take come first."""
    rank = {name: i for i, (name, _) in enumerate(model.named_modules())}

    def module_of(name: str) -> int:
        module, _, leaf = name.rpartition(".")
        target = targets.get(name)
        if target is None and leaf in SUFFIXES:  # a quantized part of a weight the model takes dense
            target = targets.get(f"{module}.weight")
        return -1 if target is None else rank.get(target[0].rpartition(".")[0], -1)

    entries = [(name, file) for file in files for name in file.keys()]
    return sorted(entries, key=lambda entry: module_of(entry[0]))  # stable: a file's order within a module


def _prepare_when_complete(
    model: CausalLM, module_name: str, state: dict[str, torch.Tensor], awaiting: Counter[str]
) -> None:
    """If `module_name` is a quantized module every part of which is read, build its CPU execution
    now (`QuantLinear.prepare_from`): when the native kernel takes it, its tiled layout becomes the
    weight's only copy at once and the read parts leave `state`, so a checkpoint's canonical tensors
    are never all resident together (weights once, during loading too)."""
    module = model.get_submodule(module_name)
    if not isinstance(module, QuantLinear) or module.qweight is None:
        return
    parts = [f"{module_name}.{leaf}" for leaf in SUFFIXES if getattr(module, leaf) is not None]
    if any(awaiting[p] or p not in state for p in parts):
        return
    weight = QuantizedWeight.of(*(state[p] for p in parts))
    if module.prepare_from(weight):
        for p in parts:
            del state[p]
        del weight
        _return_freed_memory()


def _return_freed_memory() -> None:
    """Give the pages the C heap holds free back to the system (glibc's `malloc_trim`; elsewhere
    nothing): the read tensors a module's tiled layout replaced would otherwise stay resident."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


@hugepages.packing()  # each load's small tiled weights and every scale share regions on 2 MiB pages
def load_model(
    path: str | Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    attention_backend: str | AttentionBackend = "auto",
    quantization: str = "auto",
    tp: TensorParallel | None = None,
    load_format: str = "auto",
) -> CausalLM:
    """The model in directory `path` on `device` in `dtype` (see `resolve_dtype`), in eval mode without
    gradients. Every parameter is filled exactly once from a safetensors tensor of its shape (a tied
    `lm_head.weight` may be absent, and is ignored if present); `ValueError` names the tensor that is
    missing, unexpected, duplicated or misshaped. `quantization` ("auto", "none", "int8", "int4"; see
    `helexa.model.quant.apply`) decides which weights stay or become quantized.

    With `tp` (tensor parallelism) the model holds that rank's shard (`helexa.model.parallel.sharding`) and
    only the rows or columns of each tensor the rank keeps are read. Sharding is for dense weights:
    `ValueError` for int8/int4; weights a checkpoint stores quantized are dequantised at load under
    "auto" as under "none" (those are read whole, then sliced).

    `load_format="dummy"` reads no weights: every parameter gets seeded random values of its shape on
    `device` (`dummy_weights`), so only config.json is needed; "int8"/"int4" then quantize them as they
    would a checkpoint's dense weights."""
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"unknown quantization {quantization!r}; expected one of {list(QUANTIZATION_CHOICES)}")
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"unknown load_format {load_format!r}; expected 'auto' or 'dummy'")
    start = time.perf_counter()
    path = Path(path)
    config = ModelConfig.from_pretrained(path)
    device = torch.device(device)
    dtype = resolve_dtype(dtype, device, config.dtype)
    if load_format == "dummy":
        return _dummy_model(config, path, dtype, device, attention_backend, quantization, tp, start)
    files = safetensors_files(path)
    shapes = _tensor_shapes(files)

    sharded = tp is not None and tp.size > 1
    if sharded and quantization in ("int8", "int4"):
        raise ValueError(
            f"--quantization {quantization} cannot be combined with --tensor-parallel-size > 1: tensor "
            "parallelism shards dense weights only (use --quantization none or auto with a dense checkpoint)"
        )
    if sharded and quantization == "auto" and any(name.endswith(".qweight") for name in shapes):
        log.info(f"model: {path} stores quantized weights; tensor parallelism shards dense weights, so they are "
                 "dequantised at load (as --quantization none)")  # fmt: skip
        quantization = "none"
    with torch.device("meta"):
        model = CausalLM(config, attention_backend, tp)
    plan = model.plan
    mixed = [] if quantization == "none" else _install_checkpoint_quantization(model, shapes, dtype)
    targets = _checkpoint_targets(model)
    wanted = {entry for entry, _ in targets.values()}
    specs = {  # state entry -> (shape, dtype); allocated at its first checkpoint tensor, so a quantized
        # module's read tensors live only while that module is read (and reuse the last one's memory)
        name: (t.shape, t.dtype if _is_quant_part(name) else dtype)
        for name, t in [*model.named_parameters(), *model.named_buffers()]
        if name in wanted
    }
    state: dict[str, torch.Tensor] = {}
    loaded: set[str] = set()
    pending: dict[str, dict[str, torch.Tensor]] = {}  # checkpoint module -> quantized parts read for a dense weight
    awaiting = Counter(entry for entry, _ in targets.values())  # state entry -> checkpoint tensors still to copy in
    num_bytes = 0
    with ExitStack() as stack:
        opened = [stack.enter_context(TensorFile(f)) for f in files]
        for name, file in _reading_order(opened, targets, model):
            ckpt_module, _, leaf = name.rpartition(".")
            dense_from_quant = leaf in SUFFIXES and name not in targets and f"{ckpt_module}.weight" in targets
            if name not in targets and not dense_from_quant:
                tied_head = config.tie_word_embeddings and ckpt_module == "lm_head"  # the embedding table
                if tied_head or name.endswith("rotary_emb.inv_freq"):  # older exports saved RoPE frequencies
                    continue
                raise ValueError(f"unexpected tensor {name!r} in {file.path.name} (not part of {config.architecture})")
            tensor = file.read(name) if dense_from_quant else file.read(name, plan.checkpoint_slice(name))
            loaded.add(name)
            num_bytes += tensor.numel() * tensor.element_size()
            if dense_from_quant:  # dequantised once all of the module's parts are read
                parts = pending.setdefault(ckpt_module, {})
                parts[leaf] = tensor
                if (
                    "qweight" not in parts
                    or "scales" not in parts
                    or (parts["qweight"].dtype == torch.uint8 and "zeros" not in parts)
                ):
                    continue
                weight = QuantizedWeight.of(parts["qweight"], parts["scales"], parts.get("zeros"))
                name = f"{ckpt_module}.weight"
                tensor = _narrow(weight.dequantize(torch.float32), plan.checkpoint_slice(name))
                del pending[ckpt_module]
                loaded.add(name)
            state_name, copy = targets[name]
            if state_name not in state:
                shape, entry_dtype = specs[state_name]
                state[state_name] = torch.empty(shape, dtype=entry_dtype, device=device)
            try:
                copy(state[state_name], tensor)
            except ValueError as exc:
                raise ValueError(f"tensor {name!r} in {file.path.name}: {exc}") from exc
            del tensor
            awaiting[state_name] -= 1
            if awaiting[state_name] == 0 and device.type == "cpu":
                _prepare_when_complete(model, state_name.rpartition(".")[0], state, awaiting)

    missing = sorted(set(targets) - loaded) + sorted(f"{m}.{{qweight,scales,zeros}}" for m in pending)
    if missing:
        shown = ", ".join(missing[:8]) + (f" (and {len(missing) - 8} more)" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint in {path} is missing {len(missing)} tensor(s): {shown}")
    model.load_state_dict(state, strict=True, assign=True)
    state.clear()  # the model holds the tensors now: preparing a quantized module can free its canonical copy
    _finish(model, device, quantization, mixed, f"{path} files={len(files)} read={num_bytes / 2**20:.1f}MiB", start)
    return model


def dummy_weights(model: CausalLM, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Seeded random values for every state entry of `model` (built on meta), made on `device`: the same
    name and shape give the same values on every call. Embeddings ~ N(0, 1); norm weights 1 + N(0, 0.01);
    biases N(0, 0.01); other matrices N(0, 1/fan_in), so each layer's outputs keep unit variance and the
    logits span a few units (a random model that still prefers some tokens)."""
    state = {}
    for name, meta in model.state_dict(keep_vars=True).items():
        generator = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))
        noise = torch.randn(meta.shape, generator=generator, device=device, dtype=torch.float32)
        if name.endswith("norm.weight"):
            noise = 1.0 + 0.1 * noise
        elif name.endswith("bias"):
            noise = 0.1 * noise
        elif "embed_tokens" not in name and noise.dim() > 1:
            noise = noise / meta.shape[-1] ** 0.5
        state[name] = noise.to(dtype)
        del noise
    return state


def _dummy_model(
    config: ModelConfig,
    path: Path,
    dtype: torch.dtype,
    device: torch.device,
    attention_backend: str | AttentionBackend,
    quantization: str,
    tp: TensorParallel | None,
    start: float,
) -> CausalLM:
    """`load_model` with `load_format="dummy"`: the model of `config` with `dummy_weights`."""
    with torch.device("meta"):
        model = CausalLM(config, attention_backend, tp)
    model.load_state_dict(dummy_weights(model, dtype, device), strict=True, assign=True)
    _finish(model, device, quantization, [], f"{path} (dummy weights, none read)", start)
    return model


def _finish(model: CausalLM, device: torch.device, quantization: str, mixed: list[str], source: str,
            start: float) -> None:  # fmt: skip
    """What every load ends with: buffers on the device, eval mode, quantization at load, prepared
    quantized modules, the CPU's fused step, and the log line saying what was loaded."""
    config, plan = model.config, model.plan
    dtype = model.dtype
    model.reset_buffers(device)
    model.requires_grad_(False).eval()
    skipped = quantize_decoder(model, quantization) if quantization in ("int8", "int4") else []
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.prepare()
    quantized = quantized_modules(model)
    if quantized and device.type == "cpu":
        why = native.unavailable_reason()
        log.info(f"model: cpu kernels {f'torch ({why})' if why else native.describe_path()}")
        model.native_step, why_not = native_step_for(model)
        log.info(f"model: fused CPU step {'on' if model.native_step else f'off ({why_not})'}")
    if mixed or skipped:
        log.info(f"model: left dense (mixed quantized layouts, or K not divisible by 32): {', '.join(mixed + skipped)}")
    kinds = sorted({f"{w.kind}/g{w.group_size}" for w in quantized.values()})
    log.info(
        f"model: loaded {source} arch={config.architecture} params={config.num_parameters} "
        f"dtype={str(dtype).removeprefix('torch.')} device={device} "
        f"{f'tensor_parallel={plan.rank}/{plan.size} ' if plan.size > 1 else ''}"
        f"quantization={quantization} "
        f"quantized_modules={len(quantized)}{' ' + ','.join(kinds) if kinds else ''} "
        f"in {time.perf_counter() - start:.2f}s"
    )


def _is_quant_part(state_name: str) -> bool:
    """Whether a state-dict entry is a quantized module's tensor (kept in its stored dtype)."""
    return state_name.rpartition(".")[2] in SUFFIXES
