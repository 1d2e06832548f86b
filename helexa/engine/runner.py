"""The model runner: one step's forward over the KV pool, and sampling.

The model, its pool and its tensor-parallel workers are loaded as one `LoadedModel`
(`helexa.engine.loading`), so a reload after a device fault swaps the runner and nothing else; the
blocks of the pool are the KV owner's (`helexa.kvcache.KVManager`), which builds each step's
attention metadata.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from helexa.engine.loading import LoadedModel, to_device
from helexa.engine.scheduler import ScheduledChunk
from helexa.engine.sequence import Sequence
from helexa.kvcache import AttentionMetadata, BatchBuilder, BlockTable
from helexa.model.sampling import Sampler, SampleResult
from helexa.model.sampling.grammar import allocate_bitmask


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
    """Runs the loaded model (`LoadedModel`: weights, KV pool, tensor-parallel group) one step at a time:
    `prepare` + `execute`, and the sampler.

    `prepare` builds the step's tensors over attention metadata the KV owner built (its tables grown
    from the reservations): token ids, positions and sampling rows travel in one host-to-device copy.
    `execute` runs the forward and samples with one host transfer. It holds no block: the pool it runs
    on is the KV owner's to hand out.
    """

    def __init__(self, loaded: LoadedModel) -> None:
        self.model, self.budget, self.pool, self.group = loaded.model, loaded.budget, loaded.pool, loaded.group
        self.device = loaded.pool.device
        # Checkpoints often pad the embedding past the tokenizer's vocabulary; those ids can never be
        # detokenised, so sampling only ever sees the tokenizer's columns.
        self.sample_vocab_size = loaded.sample_vocab_size
        self.sampler = Sampler()
        self._kv_caches = loaded.pool.kv_caches()

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
    def calibrate(self, prefill_tokens: int, decode_seqs: int, max_model_len: int) -> tuple[float, float] | None:
        """Measure `(decode step seconds, prefill seconds per token)` on scratch tables, before any request.

        Runs a warm-up step (first-call and kernel-compile costs stay out of the numbers), then one
        decode-shaped step of up to `decode_seqs` sequences and one prefill of up to `prefill_tokens`
        tokens, each ending in a host transfer as a real step does, on scratch tables of at most
        `max_model_len` tokens. Every block it took is free again after (call it before the KV owner
        hands out any). None when the pool or context is too small to measure on (3 blocks, 3 tokens).
        """
        pool = self.pool
        builder = BatchBuilder(pool, max(1, decode_seqs), max_model_len)
        per_table = -(-3 // pool.block_size)  # a warm-up table ends with 3 tokens
        k = min(decode_seqs, builder.max_num_seqs, pool.num_free_blocks // per_table)
        if k < 1 or builder.max_model_len < 3:
            return None
        tables = [builder.new_table() for _ in range(k)]
        try:
            self._time_forward(builder, [(tables[0], 2)] + [(t, 1) for t in tables[1:]])  # warm-up, prefill too
            decode = self._time_forward(builder, [(t, 1) for t in tables])
        finally:
            for table in tables:
                pool.decref(builder.release(table))
        p = max(1, min(prefill_tokens, pool.num_free_blocks * pool.block_size, builder.max_model_len))
        table = builder.new_table()
        try:
            prefill = self._time_forward(builder, [(table, p)])
        finally:
            pool.decref(builder.release(table))
        return decode, prefill / p

    def _time_forward(self, builder: BatchBuilder, batch: list[tuple[BlockTable, int]]) -> float:
        """Wall seconds of one forward over `batch` ((table, new tokens) pairs) to its sampled rows on the host."""
        start = time.perf_counter()
        starts = [t.num_tokens for t, _ in batch]
        attn = builder.build(batch)
        positions = [pos for (_, n), s0 in zip(batch, starts) for pos in range(s0, s0 + n)]
        ids = [1 + pos % max(1, self.sample_vocab_size - 1) for pos in positions]
        rows = list(itertools.accumulate(n for _, n in batch))
        packed = to_device(ids + positions + [r - 1 for r in rows], self.device)
        t = len(ids)
        logits = self._forward(packed[:t], packed[t : 2 * t], attn, packed[2 * t :])
        logits.argmax(dim=-1).tolist()  # (B,): the one host transfer a step ends with
        return time.perf_counter() - start

    def prepare(self, chunks: list[ScheduledChunk[Sequence]], attn: AttentionMetadata) -> StepInputs:
        """The flattened varlen batch of the chunks, over `attn` (the KV owner's tables for them, in chunk order)."""
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
        packed = to_device(ids + positions + sample_rows, self.device)  # (2T + S,): one transfer
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
        bitmask = None  # structured output: the tokens each row may sample (the sampler masks after logprobs)
        if constraints:
            width = max(logits.shape[1], *(c.vocab_size for _, c in constraints))
            bitmask = allocate_bitmask(len(seqs), width)  # (S, ceil(width / 32)) int32 on the host, all allowed
            for row, constraint in constraints:
                constraint.fill(bitmask, row)
        try:
            return self._sample(logits, seqs, generators, bitmask), {}
        except Exception:  # find the rows that cause it; the others keep their one vectorised call
            failures: dict[int, Exception] = {}
            for row, seq in enumerate(seqs):
                try:
                    rows_mask = None if bitmask is None else bitmask[row : row + 1]
                    self._sample(logits[row : row + 1], [seq], generators[row : row + 1], rows_mask)
                except Exception as exc:
                    failures[row] = exc
            if not failures:
                raise
            ok = [row for row in range(len(seqs)) if row not in failures]
            if not ok:
                return SampleResult([], [], []), failures
            ok_mask = None if bitmask is None else bitmask[ok]
            partial = self._sample(logits[ok], [seqs[r] for r in ok], [generators[r] for r in ok], ok_mask)
            merged = SampleResult([-1] * len(seqs), [None] * len(seqs), [None] * len(seqs))
            for i, row in enumerate(ok):
                merged.token_ids[row] = partial.token_ids[i]
                merged.logprobs[row] = partial.logprobs[i]
                merged.top_logprobs[row] = partial.top_logprobs[i]
            return merged, failures

    def _sample(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        generators: list[torch.Generator | None],
        bitmask: torch.Tensor | None = None,
    ) -> SampleResult:
        need_history = any(s.params.uses_penalties for s in seqs)
        return self.sampler.sample(
            logits,
            [s.params for s in seqs],
            generators,
            prompt_ids=[s.prompt_ids for s in seqs] if need_history else None,
            output_ids=[s.output_ids for s in seqs] if need_history else None,
            bitmask=bitmask,
        )
