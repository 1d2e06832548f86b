"""The model runner: the loaded model with its KV pool — built and dropped as one — and each step's forward.

`ModelRunner(...)` loads the weights, derives the KV budget and allocates the pool, so a reload after
a device fault swaps the whole runner and nothing else.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from helexa.config import EngineConfig
from helexa.engine.scheduler import ScheduledChunk
from helexa.engine.sequence import Sequence
from helexa.kvcache import (
    AttentionMetadata,
    BatchBuilder,
    BlockPool,
    BlockTable,
    PrefixCache,
    estimate_activation_bytes,
    kv_budget,
)
from helexa.model.config import ModelConfig
from helexa.model.loader import load_model
from helexa.model.sampling import Sampler, SampleResult
from helexa.model.sampling.grammar import allocate_bitmask, apply_masks

logger = logging.getLogger("helexa.engine")


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
    ) -> None:
        """Load the weights and allocate the KV pool the config gives.

        The block count is a function of the config and the model's shapes only (never of a live
        free-memory reading), so every load of the same config gives the same count.
        """
        model = load_model(model_dir, dtype=dtype, device=device, attention_backend=config.attention_backend)
        max_num_seqs = config.admission.max_num_seqs
        budget = kv_budget(
            block_size=config.block_size,
            num_layers=mc.num_hidden_layers,
            num_kv_heads=mc.num_key_value_heads,
            head_dim=mc.head_dim,
            dtype=dtype,
            device=device,
            weight_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
            activation_reserve_bytes=estimate_activation_bytes(
                hidden_size=mc.hidden_size,
                intermediate_size=mc.intermediate_size,
                num_heads=mc.num_attention_heads,
                num_kv_heads=mc.num_key_value_heads,
                head_dim=mc.head_dim,
                vocab_size=mc.vocab_size,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=max_num_seqs,
                dtype=dtype,
            ),
            num_blocks=config.num_blocks,
            kv_cache_memory=config.kv_cache_memory,
            gpu_memory_utilization=config.gpu_memory_utilization,
        )
        logger.info("%s", budget.describe())
        pool = BlockPool(
            budget.num_blocks,
            config.block_size,
            mc.num_hidden_layers,
            mc.num_key_value_heads,
            mc.head_dim,
            dtype,
            device,
        )
        self.model, self.budget, self.pool, self.device = model, budget, pool, device
        self.builder = BatchBuilder(pool, max_num_seqs, max_model_len)
        self.cache = (
            PrefixCache(pool.allocator, config.block_size, retention_secs=config.prefix_retention_secs)
            if config.prefix_cache
            else None
        )
        # Checkpoints often pad the embedding past the tokenizer's vocabulary; those ids can never be
        # detokenised, so sampling only ever sees the tokenizer's columns.
        self.sample_vocab_size = min(tokenizer_vocab, mc.vocab_size)
        self.sampler = Sampler()
        self._kv_caches = pool.kv_caches()

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
        logits = self.model(packed[:t], packed[t : 2 * t], attn, self._kv_caches, packed[2 * t :])
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
        self, inputs: StepInputs, generators: list[torch.Generator | None]
    ) -> tuple[SampleResult | None, dict[int, Exception]]:
        """Run the forward over the batch and sample one token for each sampling row.

        Returns the samples (None when no row samples) and the rows whose sampling failed because
        of their own parameters, with the error: a failure that one request's parameters cause is
        that request's, never a device fault. Exceptions from the forward propagate.
        """
        logits = self.model(inputs.input_ids, inputs.positions, inputs.attn, self._kv_caches, inputs.logits_indices)
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


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 tensor of `values` on `device` (one pinned, non-blocking copy on CUDA)."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)
