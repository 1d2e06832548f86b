"""Loading a model for the engine: its weights (this rank's shard), its KV budget and pool, an fp8 pool's scales,
and the tensor-parallel workers — built as one `LoadedModel` at start and again on every reload.

The block count is a function of the config and the model's shapes only (never of a live free-memory
reading), so every load of the same config gives the same count.

`--kv-cache-dtype fp8`: the pool holds float8 e4m3 with one float32 scale per layer, KV head, K and
V. The scales are calibrated once per load, before the pool is allocated: one prefill of a fixed
text (`KV_CALIBRATION_TEXT`, tokenized by the engine; `kv_calibration_ids`) into a small scratch
pool in the model dtype gives each head's largest |K| and |V|, and `scale = amax * 2 / 448`
(`helexa.kvcache.fp8_scales`): values up to twice the calibrated range are represented, larger ones
saturate at ±448 x scale (never inf or NaN). Same weights and text, same scales: a reload after a
device fault calibrates to the same numbers, and the prefix cache shares blocks written with them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

import torch

from helexa.config import EngineConfig
from helexa.engine.parallel.group import TensorParallelGroup, WorkerSpec, fault_injection, group_address
from helexa.engine.parallel.step import initial_capacity
from helexa.kernels import FP8_KV_DTYPE
from helexa.kvcache import BatchBuilder, BlockPool, KVBudget, estimate_activation_bytes, fp8_scales, kv_budget
from helexa.model.config import ModelConfig
from helexa.model.loader import load_model
from helexa.model.parallel.comm import TensorParallel
from helexa.model.parallel.sharding import ShardPlan
from helexa.model.resident import resident_weight_bytes
from helexa.model.text import Tokenizer
from helexa.model.transformer import CausalLM
from helexa.values import parse_size

logger = logging.getLogger("helexa.engine")

# The text whose K/V an fp8 cache's scales are calibrated on: prose, dialogue, code, numbers and lists.
KV_CALIBRATION_TEXT = """\
The history of the lighthouse at the edge of the bay goes back to 1827, when a wooden tower with
twelve oil lamps was built on the rocks to warn ships away from the shoals. It burned down twice.
The stone tower that stands there today was finished in 1871; its lens, made in Paris, weighs
more than four tonnes and floats on a bath of mercury so that a single keeper could turn it by hand.

"Do you think the storm will reach us tonight?" asked Maria, looking at the darkening sky.
"The barometer has dropped eleven millibars since noon," her brother answered. "Close the shutters."

To compute the average of a list of numbers in Python, sum them and divide by their count:

    def mean(values: list[float]) -> float:
        if not values:
            raise ValueError("mean of an empty list")
        return sum(values) / len(values)

    print(mean([3.5, 7.25, 10.0, -2.75]))  # 4.5

Quarterly results: revenue rose 14.2% to $3.81 billion, operating margin was 22.9%, and the
company expects 2,450 to 2,600 new hires next year, mostly in Berlin, Toronto, Singapore and Austin.

Steps to repot a plant: 1) water it a day before; 2) choose a pot 2-5 cm wider; 3) loosen the roots
gently; 4) add fresh soil and press it down; 5) water thoroughly and keep it out of direct sun for a week.

Translation exercise: "Le chat dort sur le canapé" means "The cat sleeps on the sofa", and
"Wo ist der Bahnhof?" asks where the train station is. Mathematics: e^(i*pi) + 1 = 0; the integral
of x^2 from 0 to 3 is 9; 17 * 23 = 391; the square root of 2 is about 1.41421356.
"""
KV_CALIBRATION_MAX_TOKENS = 512


def kv_calibration_ids(tokenizer: Tokenizer) -> list[int]:
    """`KV_CALIBRATION_TEXT` as the model sees a request: a user turn of its chat template (the special
    tokens every request carries), or the plain text with the tokenizer's special tokens when the model
    has no template."""
    if tokenizer.chat_template is not None:
        try:
            return tokenizer.apply_chat_template(
                [{"role": "user", "content": KV_CALIBRATION_TEXT}], add_generation_prompt=True
            )
        except Exception as exc:  # a template that cannot render this: the plain text still calibrates
            logger.warning("kv calibration: chat template failed (%s); using the plain text", exc)
    return tokenizer.encode(KV_CALIBRATION_TEXT)


def kv_cache_dtype(name: str, model_dtype: torch.dtype, fused_cpu_step: bool = False) -> torch.dtype:
    """The pool's dtype for `--kv-cache-dtype NAME`: for "auto", float16 under the fused CPU step of a
    float32 model (llama.cpp's KV bytes; its teacher-forced agreement with float32 KV is that of any
    change of float32 rounding on the quantized model, and 99.9-100% where int8 activations do not blur
    the measure: bench/RESULTS.md), else the model's dtype; float8 e4m3 for "fp8"/"fp8_e4m3"; "float16" or
    "float32" as named, where the model can use it (its own dtype, or float16 under the fused step)."""
    if name == "auto":
        return torch.float16 if fused_cpu_step and model_dtype == torch.float32 else model_dtype
    if name in ("fp8", "fp8_e4m3"):
        return FP8_KV_DTYPE
    if name in ("float16", "float32"):
        dtype = getattr(torch, name)
        if dtype != model_dtype and not (fused_cpu_step and dtype == torch.float16):
            raise ValueError(
                f"--kv-cache-dtype {name} needs a {name} model or (float16) the fused CPU step of a quantized "
                f"model; this one runs {str(model_dtype).removeprefix('torch.')}"
                f"{'' if fused_cpu_step else ' without the fused step'}"
            )
        return dtype
    raise ValueError(f"unknown kv_cache_dtype {name!r}; expected auto, fp8, fp8_e4m3, float16 or float32")


@dataclass(frozen=True)
class LoadedModel:
    """What one load gives: the model (rank 0's shard), its KV budget and the pool of `budget.num_blocks`
    blocks, the tensor-parallel worker group (None on one rank), and how many vocabulary columns sample
    (the tokenizer's: a checkpoint may pad its embedding past them)."""

    model: CausalLM
    budget: KVBudget
    pool: BlockPool
    group: TensorParallelGroup | None
    sample_vocab_size: int


def load(
    config: EngineConfig,
    model_dir: Path,
    mc: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    tokenizer_vocab: int,
    *,
    calibration_ids: Seq[int] | None = None,
) -> LoadedModel:
    """Load the weights and allocate the KV pool the config gives (spawning the tensor-parallel workers first,
    which load their shards meanwhile; every rank then allocates the smallest of the ranks' counts). For an
    fp8 pool, `calibration_ids` are the tokens its scales are calibrated on (`kv_calibration_ids`; default: a
    fixed synthetic sequence). Nothing outlives a failed load (the workers are stopped)."""
    if config.kv_cache_dtype in ("fp8", "fp8_e4m3") and device.type == "cuda" and config.attention_backend != "torch":
        if torch.cuda.get_device_capability(device) < (8, 9):  # Triton's e4m3 needs sm_89+
            raise ValueError(
                "--kv-cache-dtype fp8 needs a GPU of compute capability 8.9 or later (Ada, Hopper) for the "
                "Triton kernels; use --attention-backend torch on this one"
            )
    size = config.tensor_parallel_size
    group = _spawn_group(config, model_dir, mc, dtype, device, max_model_len) if size > 1 else None
    try:
        model, budget = load_shard(config, model_dir, dtype, device, max_model_len, rank=0, size=size)
        kv_dtype = kv_cache_dtype(config.kv_cache_dtype, dtype, model.native_step is not None)
        logger.info("%s", budget.describe())
        if group is not None:  # every rank allocates the smallest of the ranks' counts
            budget = dataclasses.replace(budget, num_blocks=group.agree(budget.num_blocks))
        sample_vocab_size = min(tokenizer_vocab, mc.vocab_size)
        scales = None
        if kv_dtype == FP8_KV_DTYPE:  # before the pool: the scratch pool's memory is back by then
            if calibration_ids is None:
                calibration_ids = [1 + (7919 * i) % max(1, sample_vocab_size - 1) for i in range(256)]
            ids = list(calibration_ids)[: min(KV_CALIBRATION_MAX_TOKENS, max_model_len)]
            scales = calibrate_kv_scales(
                model, mc, dtype, device, ids, config.block_size, config.max_num_batched_tokens
            )
        pool = BlockPool(
            budget.num_blocks,
            config.block_size,
            mc.num_hidden_layers,
            model.plan.num_kv_heads,  # this rank's share under tensor parallelism
            mc.head_dim,
            kv_dtype,
            device,
        )
        if scales is not None:
            pool.set_kv_scales(*scales)
        if group is not None:
            group.confirm(pool.num_blocks)
    except BaseException:
        if group is not None:
            group.close(graceful=False)
        raise
    return LoadedModel(model, budget, pool, group, sample_vocab_size)


def load_shard(
    config: EngineConfig,
    model_dir: Path | str,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    *,
    rank: int = 0,
    size: int = 1,
) -> tuple[CausalLM, KVBudget]:
    """Rank `rank`'s shard of the model (all of it when `size == 1`) and this rank's own KV budget.

    The budget counts this rank's KV heads, its resident weights and activations, from this rank's
    totals: its GPU's memory; on a CPU the host's RAM divided by `size` (the ranks share it); or, for
    tests, `HELEXA_TP_MEMORY_TOTALS` (one size per rank). The tensor-parallel group then agrees on
    the smallest count over the ranks. Same config, same totals: same count, on every load.
    """
    mc = ModelConfig.from_pretrained(model_dir)
    tp = TensorParallel(ShardPlan.for_model(mc, rank, size)) if size > 1 else None
    model = load_model(
        model_dir,
        dtype=dtype,
        device=device,
        attention_backend=config.attention_backend,
        quantization=config.quantization,
        tp=tp,
        load_format=config.load_format,
    )
    plan = model.plan
    totals = rank_memory_totals(size) if size > 1 else None
    budget = kv_budget(
        block_size=config.block_size,
        num_layers=mc.num_hidden_layers,
        num_kv_heads=plan.num_kv_heads,
        head_dim=mc.head_dim,
        dtype=kv_cache_dtype(config.kv_cache_dtype, dtype, model.native_step is not None),
        device=device,
        weight_bytes=resident_weight_bytes(model),
        activation_reserve_bytes=estimate_activation_bytes(
            hidden_size=mc.hidden_size,
            intermediate_size=plan.intermediate_size,
            num_heads=plan.num_heads,
            num_kv_heads=plan.num_kv_heads,
            head_dim=mc.head_dim,
            vocab_size=max(1, plan.vocab_rows) if size > 1 else mc.vocab_size,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.admission.max_num_seqs,
            dtype=dtype,
        ),
        num_blocks=config.num_blocks,
        kv_cache_memory=config.kv_cache_memory,
        gpu_memory_utilization=config.gpu_memory_utilization,
        total_memory_bytes=totals[rank] if totals is not None else None,
        memory_share=size if device.type != "cuda" else 1,
    )
    return model, budget


def rank_memory_totals(size: int) -> list[int] | None:
    """The per-rank memory totals `HELEXA_TP_MEMORY_TOTALS` injects (a test hook: sizes such as
    `64MiB,48MiB`, one per rank), or None when it is unset. `ValueError` when it is malformed."""
    text = os.environ.get("HELEXA_TP_MEMORY_TOTALS", "").strip()
    if not text:
        return None
    try:
        totals = [parse_size(part.strip()) for part in text.split(",")]
    except ValueError as exc:
        raise ValueError(f"HELEXA_TP_MEMORY_TOTALS: {exc}") from None
    if len(totals) != size:
        raise ValueError(f"HELEXA_TP_MEMORY_TOTALS lists {len(totals)} totals for {size} tensor-parallel ranks")
    return totals


def _spawn_group(
    config: EngineConfig, model_dir: Path, mc: ModelConfig, dtype: torch.dtype, device: torch.device, max_model_len: int
) -> TensorParallelGroup:
    """Start the N-1 worker ranks of `config.tensor_parallel_size` (checked against the model and the devices first)."""
    size = config.tensor_parallel_size
    ShardPlan.for_model(mc, 0, size)  # a model that cannot be split is refused before any process starts
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(
            f"--tensor-parallel-size {size} needs {size} GPUs (one per rank); this host has {torch.cuda.device_count()}"
        )
    rank_memory_totals(size)  # validated before any process starts
    threads = max(1, (os.cpu_count() or 1) // size)
    if device.type == "cpu" and torch.get_num_threads() > threads:
        # The ranks share the host's cores: more threads than cores makes each rank's idle threads spin
        # while the others compute, and every collective then waits a scheduler slice.
        logger.info("tensor parallel: torch threads %d -> %d per rank (%d ranks on this CPU)",
                    torch.get_num_threads(), threads, size)  # fmt: skip
        torch.set_num_threads(threads)
    addr, port = group_address()
    fault_rank, fault_steps, fault_mode = fault_injection(size)
    spec = WorkerSpec(
        config=config,
        model_dir=str(model_dir),
        dtype=dtype,
        device_type=device.type,
        max_model_len=max_model_len,
        size=size,
        addr=addr,
        port=port,
        timeout_secs=config.step_timeout_secs,
        capacity=initial_capacity(config.max_num_batched_tokens, config.admission.max_num_seqs),
        threads=threads,
        fault_rank=fault_rank,
        fault_steps=fault_steps,
        fault_mode=fault_mode,
        env={"MASTER_ADDR": addr, "MASTER_PORT": str(port), "WORLD_SIZE": str(size)},
    )
    return TensorParallelGroup.spawn(spec, mc)


@torch.inference_mode()
def calibrate_kv_scales(
    model: torch.nn.Module,
    mc: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    token_ids: list[int],
    block_size: int,
    chunk_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 scales `(k_scale, v_scale)`, each (num_layers, num_kv_heads) float32, from a prefill of
    `token_ids` (in chunks of at most `chunk_tokens`, as the engine's steps) into a scratch pool in the
    model's `dtype` (freed on return): `fp8_scales` of each layer's and KV head's largest |K| and |V|
    over the tokens (RoPE and any k-norm applied, as written to the cache)."""
    if not token_ids:
        raise ValueError("kv calibration needs at least one token")
    n = len(token_ids)
    layers, kv_heads = mc.num_hidden_layers, mc.num_key_value_heads
    scratch = BlockPool(-(-n // block_size), block_size, layers, kv_heads, mc.head_dim, dtype, device)
    builder = BatchBuilder(scratch, 1, n)  # blocks the scratch table takes are freed with the scratch pool
    table = builder.new_table()
    for start in range(0, n, max(1, chunk_tokens)):
        chunk = token_ids[start : start + max(1, chunk_tokens)]
        m = len(chunk)
        attn = builder.build([(table, m)])
        packed = to_device(chunk + list(range(start, start + m)) + [m - 1], device)
        model(packed[:m], packed[m : 2 * m], attn, scratch.kv_caches(), packed[2 * m :])
    # (L, 2, KVH): unwritten rows are zeros and never raise a maximum
    amax = torch.stack([torch.stack([c.abs().amax(dim=(0, 1, 3)) for c in kv]) for kv in scratch.kv_caches()])
    scales = fp8_scales(amax.float())
    logger.info(
        "kv cache fp8: scales calibrated on %d tokens: |K| max %.3g..%.3g, |V| max %.3g..%.3g over layers and heads",
        n, float(amax[:, 0].min()), float(amax[:, 0].max()), float(amax[:, 1].min()), float(amax[:, 1].max()),
    )  # fmt: skip
    return scales[:, 0].contiguous(), scales[:, 1].contiguous()


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 tensor of `values` on `device` (one pinned, non-blocking copy on CUDA)."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)
