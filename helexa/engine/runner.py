"""The model runner: the loaded model with its KV pool — built and dropped as one — and each step's forward.

`ModelRunner(...)` loads the weights, derives the KV budget and allocates the pool, so a reload after
a device fault swaps the whole runner and nothing else.

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
import itertools
import logging
import os
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

import torch

from helexa.config import EngineConfig, parse_size
from helexa.engine.scheduler import ScheduledChunk
from helexa.engine.sequence import Sequence
from helexa.kernels import FP8_KV_DTYPE
from helexa.kvcache import (
    AttentionMetadata,
    BatchBuilder,
    BlockPool,
    BlockTable,
    KVBudget,
    PrefixCache,
    estimate_activation_bytes,
    fp8_scales,
    kv_budget,
)
from helexa.model.config import ModelConfig
from helexa.model.loader import load_model
from helexa.model.sampling import Sampler, SampleResult
from helexa.model.sampling.grammar import allocate_bitmask, apply_masks
from helexa.model.text import Tokenizer
from helexa.model.transformer import CausalLM
from helexa.parallel.comm import TensorParallel
from helexa.parallel.group import TensorParallelGroup, WorkerSpec, fault_injection, group_address
from helexa.parallel.sharding import ShardPlan
from helexa.parallel.step import initial_capacity

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


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's dtype for `--kv-cache-dtype NAME`: the model's for "auto", float8 e4m3 for "fp8"/"fp8_e4m3"."""
    if name == "auto":
        return model_dtype
    if name in ("fp8", "fp8_e4m3"):
        return FP8_KV_DTYPE
    raise ValueError(f"unknown kv_cache_dtype {name!r}; expected auto, fp8 or fp8_e4m3")


@dataclass(frozen=True)
class StepInputs:
    """Everything one forward needs, built once per step (never per layer)."""

    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # (S,) int64 — rows of the flattened batch that sample
    sampled: list[Sequence]  # the S sequences, in row order
    num_decode_tokens: int
    num_prefill_tokens: int


class ModelRunner:
    """Owns the model, its KV pool, prefix cache and batch builder, and the sampler; one `prepare` +
    `execute` per step.

    `prepare` extends each scheduled sequence's block table (allocating from the pool, which
    admission has reserved for it, so it never runs out: empty blocks first, then cached ones the
    prefix cache evicts, least recently used first) and builds the step's tensors: token ids,
    positions and sampling rows travel in one host-to-device copy, the attention metadata in another
    (the batch builder's). `execute` runs the forward and samples with one host transfer.
    """

    def __init__(
        self,
        config: EngineConfig,
        model_dir: Path,
        mc: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        tokenizer_vocab: int,
        *,
        calibration_ids: Seq[int] | None = None,
    ) -> None:
        """Load the weights and allocate the KV pool the config gives.

        The block count is a function of the config and the model's shapes only (never of a live
        free-memory reading), so every load of the same config gives the same count. For an fp8
        pool, `calibration_ids` are the tokens its scales are calibrated on (`kv_calibration_ids`;
        default: a fixed synthetic sequence).
        """
        kv_dtype = kv_cache_dtype(config.kv_cache_dtype, dtype)
        if kv_dtype == FP8_KV_DTYPE and device.type == "cuda" and config.attention_backend != "torch":
            if torch.cuda.get_device_capability(device) < (8, 9):  # Triton's e4m3 needs sm_89+
                raise ValueError(
                    "--kv-cache-dtype fp8 needs a GPU of compute capability 8.9 or later (Ada, Hopper) for the "
                    "Triton kernels; use --attention-backend torch on this one"
                )
        size = config.tensor_parallel_size
        # Tensor parallelism: the workers load their shards while this process (rank 0) loads its own.
        self.group = _spawn_group(config, model_dir, mc, dtype, device, max_model_len) if size > 1 else None
        try:
            model, budget = load_shard(config, model_dir, dtype, device, max_model_len, rank=0, size=size)
            logger.info("%s", budget.describe())
            if self.group is not None:  # every rank allocates the smallest of the ranks' counts
                budget = dataclasses.replace(budget, num_blocks=self.group.agree(budget.num_blocks))
            self._build(
                config, model, budget, mc, kv_dtype, dtype, device, max_model_len, tokenizer_vocab, calibration_ids
            )
            if self.group is not None:
                self.group.confirm(self.pool.num_blocks)
        except BaseException:
            if self.group is not None:
                self.group.close(graceful=False)
            raise

    def _build(
        self,
        config: EngineConfig,
        model: CausalLM,
        budget: KVBudget,
        mc: ModelConfig,
        kv_dtype: torch.dtype,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        tokenizer_vocab: int,
        calibration_ids: Seq[int] | None,
    ) -> None:
        """Calibrate an fp8 pool's scales, allocate the pool of `budget.num_blocks` blocks (this rank's KV
        heads), and set up the batch builder, prefix cache and sampler."""
        max_num_seqs = config.admission.max_num_seqs
        # Sample only the tokenizer's columns (see below); calibration draws its synthetic ids from them too.
        self.sample_vocab_size = min(tokenizer_vocab, mc.vocab_size)
        scales = None
        if kv_dtype == FP8_KV_DTYPE:  # before the pool: the scratch pool's memory is back by then
            if calibration_ids is None:
                calibration_ids = [1 + (7919 * i) % max(1, self.sample_vocab_size - 1) for i in range(256)]
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
        self.model, self.budget, self.pool, self.device = model, budget, pool, device
        self.builder = BatchBuilder(pool, max_num_seqs, max_model_len)
        self.cache = (
            PrefixCache(pool.allocator, config.block_size, retention_secs=config.prefix_retention_secs)
            if config.prefix_cache
            else None
        )
        # Checkpoints often pad the embedding past the tokenizer's vocabulary; those ids can never be
        # detokenised, so sampling only ever sees the tokenizer's columns (`sample_vocab_size`, above).
        self.sampler = Sampler()
        self._kv_caches = pool.kv_caches()

    def close(self, graceful: bool = True) -> None:
        """Stop the tensor-parallel workers, if any (idempotent); `graceful=False` after a fault. The
        model and pool stay readable on this process, but no forward runs after this."""
        if self.group is not None:
            self.group.close(graceful)

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        logits_indices: torch.Tensor,
        step_no: int = 0,
    ) -> torch.Tensor:
        """The model over one step's inputs on the pool: (S, V) float32 logits. Tensor-parallel: the
        inputs go to the workers in one broadcast first, and every rank runs its shard."""
        if self.group is None:
            return self.model(input_ids, positions, attn, self._kv_caches, logits_indices)
        return self.group.run(
            lambda: self.model(input_ids, positions, attn, self._kv_caches, logits_indices),
            input_ids, positions, attn, logits_indices, step_no,
        )  # fmt: skip

    @torch.inference_mode()
    def calibrate(self, prefill_tokens: int, decode_seqs: int) -> tuple[float, float] | None:
        """Measure `(decode step seconds, prefill seconds per token)` on scratch tables, before any request.

        Runs a warm-up step (first-call and kernel-compile costs stay out of the numbers), then one
        decode-shaped step of up to `decode_seqs` sequences and one prefill of up to `prefill_tokens`
        tokens, each ending in a host transfer as a real step does. Every block it took is free again
        after. None when the pool or context is too small to measure on (3 blocks, 3 tokens).
        """
        pool, builder = self.pool, self.builder
        per_table = -(-3 // pool.block_size)  # a warm-up table ends with 3 tokens
        k = min(decode_seqs, builder.max_num_seqs, pool.num_free_blocks // per_table)
        if k < 1 or builder.max_model_len < 3:
            return None
        tables = [builder.new_table() for _ in range(k)]
        try:
            self._time_forward([(tables[0], 2)] + [(t, 1) for t in tables[1:]])  # warm-up, prefill-shaped too
            decode = self._time_forward([(t, 1) for t in tables])
        finally:
            for table in tables:
                builder.release(table)
        p = max(1, min(prefill_tokens, pool.num_free_blocks * pool.block_size, builder.max_model_len))
        table = builder.new_table()
        try:
            prefill = self._time_forward([(table, p)])
        finally:
            builder.release(table)
        return decode, prefill / p

    def _time_forward(self, batch: list[tuple[BlockTable, int]]) -> float:
        """Wall seconds of one forward over `batch` ((table, new tokens) pairs) to its sampled rows on the host."""
        start = time.perf_counter()
        starts = [t.num_tokens for t, _ in batch]
        attn = self.builder.build(batch)
        positions = [pos for (_, n), s0 in zip(batch, starts) for pos in range(s0, s0 + n)]
        ids = [1 + pos % max(1, self.sample_vocab_size - 1) for pos in positions]
        rows = list(itertools.accumulate(n for _, n in batch))
        packed = _to_device(ids + positions + [r - 1 for r in rows], self.device)
        t = len(ids)
        logits = self._forward(packed[:t], packed[t : 2 * t], attn, packed[2 * t :])
        logits.argmax(dim=-1).tolist()  # (B,): the one host transfer a step ends with
        return time.perf_counter() - start

    def prepare(self, chunks: list[ScheduledChunk[Sequence]]) -> StepInputs:
        """Allocate the chunks' blocks and build the flattened varlen batch for them."""
        ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        sampled: list[Sequence] = []
        num_decode = num_prefill = 0
        for chunk in chunks:
            seq = chunk.seq
            start = seq.num_computed
            ids.extend(seq.token_ids[start : start + chunk.num_new])
            positions.extend(range(start, start + chunk.num_new))
            if chunk.samples:
                sample_rows.append(len(ids) - 1)
                sampled.append(seq)
            if seq.in_prefill:
                num_prefill += chunk.num_new
            else:
                num_decode += chunk.num_new
        batch = [(chunk.seq.table, chunk.num_new) for chunk in chunks]
        if self.cache is not None:
            self.cache.ensure_free(self.builder.blocks_needed(batch))
        attn = self.builder.build(batch)
        packed = _to_device(ids + positions + sample_rows, self.device)  # (2T + S,): one transfer
        num_tokens = len(ids)
        return StepInputs(
            input_ids=packed[:num_tokens],
            positions=packed[num_tokens : 2 * num_tokens],
            attn=attn,
            logits_indices=packed[2 * num_tokens :],
            sampled=sampled,
            num_decode_tokens=num_decode,
            num_prefill_tokens=num_prefill,
        )

    @torch.inference_mode()
    def execute(
        self, inputs: StepInputs, generators: list[torch.Generator | None], step_no: int = 0
    ) -> tuple[SampleResult | None, dict[int, Exception]]:
        """Run the forward over the batch and sample one token for each sampling row.

        Returns the samples (None when no row samples) and the rows whose sampling failed because
        of their own parameters, with the error: a failure that one request's parameters cause is
        that request's, never a device fault. Exceptions from the forward propagate (under tensor
        parallelism a `TensorParallelFault` naming the rank). `step_no`: the engine step, for the
        workers' fault injection (0: not an engine step).
        """
        logits = self._forward(inputs.input_ids, inputs.positions, inputs.attn, inputs.logits_indices, step_no)
        if not inputs.sampled:
            return None, {}
        if self.sample_vocab_size is not None and self.sample_vocab_size < logits.shape[1]:
            logits = logits[:, : self.sample_vocab_size]  # (S, V_tokenizer)
        seqs = inputs.sampled
        constraints = [(row, seq.constraint) for row, seq in enumerate(seqs) if seq.constraint is not None]
        if constraints:  # structured output: forbidden tokens to -inf, in those rows only
            width = max(logits.shape[1], *(c.vocab_size for _, c in constraints))
            bitmask = allocate_bitmask(len(constraints), width)  # (R, ceil(width / 32)) int32, on the host
            for i, (_, constraint) in enumerate(constraints):
                constraint.fill(bitmask, i)
            apply_masks(logits, bitmask, [row for row, _ in constraints])
        try:
            return self._sample(logits, seqs, generators), {}
        except Exception:  # find the rows that cause it; the others keep their one vectorised call
            failures: dict[int, Exception] = {}
            for row, seq in enumerate(seqs):
                try:
                    self._sample(logits[row : row + 1], [seq], generators[row : row + 1])
                except Exception as exc:
                    failures[row] = exc
            if not failures:
                raise
            ok = [row for row in range(len(seqs)) if row not in failures]
            if not ok:
                return SampleResult([], [], []), failures
            partial = self._sample(logits[ok], [seqs[r] for r in ok], [generators[r] for r in ok])
            merged = SampleResult([-1] * len(seqs), [None] * len(seqs), [None] * len(seqs))
            for i, row in enumerate(ok):
                merged.token_ids[row] = partial.token_ids[i]
                merged.logprobs[row] = partial.logprobs[i]
                merged.top_logprobs[row] = partial.top_logprobs[i]
            return merged, failures

    def _sample(
        self, logits: torch.Tensor, seqs: list[Sequence], generators: list[torch.Generator | None]
    ) -> SampleResult:
        need_history = any(s.params.uses_penalties for s in seqs)
        return self.sampler.sample(
            logits,
            [s.params for s in seqs],
            generators,
            prompt_ids=[s.prompt_ids for s in seqs] if need_history else None,
            output_ids=[s.output_ids for s in seqs] if need_history else None,
        )


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
    )
    plan = model.plan
    totals = rank_memory_totals(size) if size > 1 else None
    budget = kv_budget(
        block_size=config.block_size,
        num_layers=mc.num_hidden_layers,
        num_kv_heads=plan.num_kv_heads,
        head_dim=mc.head_dim,
        dtype=kv_cache_dtype(config.kv_cache_dtype, dtype),
        device=device,
        weight_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
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
    builder = BatchBuilder(scratch, 1, n)
    table = builder.new_table()
    for start in range(0, n, max(1, chunk_tokens)):
        chunk = token_ids[start : start + max(1, chunk_tokens)]
        m = len(chunk)
        attn = builder.build([(table, m)])
        packed = _to_device(chunk + list(range(start, start + m)) + [m - 1], device)
        model(packed[:m], packed[m : 2 * m], attn, scratch.kv_caches(), packed[2 * m :])
    # (L, 2, KVH): unwritten rows are zeros and never raise a maximum
    amax = torch.stack([torch.stack([c.abs().amax(dim=(0, 1, 3)) for c in kv]) for kv in scratch.kv_caches()])
    scales = fp8_scales(amax.float())
    logger.info(
        "kv cache fp8: scales calibrated on %d tokens: |K| max %.3g..%.3g, |V| max %.3g..%.3g over layers and heads",
        n, float(amax[:, 0].min()), float(amax[:, 0].max()), float(amax[:, 1].min()), float(amax[:, 1].max()),
    )  # fmt: skip
    return scales[:, 0].contiguous(), scales[:, 1].contiguous()


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 tensor of `values` on `device` (one pinned, non-blocking copy on CUDA)."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)
