"""The model runner: turns a step's scheduled chunks into model inputs, runs the model, samples."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from helexa.engine.scheduler import ScheduledChunk
from helexa.engine.sequence import Sequence
from helexa.kvcache import AttentionMetadata, BatchBuilder, BlockPool
from helexa.model.sampling import Sampler, SampleResult
from helexa.model.transformer import CausalLM


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
    """Owns the model, the pool's batch builder and the sampler; one `prepare` + `execute` per step.

    `prepare` extends each scheduled sequence's block table (allocating from the pool, which
    admission has reserved for it, so it never runs out) and builds the step's tensors: token ids,
    positions and sampling rows travel in one host-to-device copy, the attention metadata in another
    (the batch builder's). `execute` runs the forward and samples with one host transfer.
    """

    def __init__(self, model: CausalLM, pool: BlockPool, builder: BatchBuilder, device: torch.device,
                 sample_vocab_size: int | None = None) -> None:
        self.model = model
        # Checkpoints often pad the embedding past the tokenizer's vocabulary; those ids can never be
        # detokenised, so sampling only ever sees the tokenizer's columns.
        self.sample_vocab_size = sample_vocab_size
        self.pool = pool
        self.builder = builder
        self.device = device
        self.sampler = Sampler()
        self._kv_caches = pool.kv_caches()

    def prepare(self, chunks: list[ScheduledChunk]) -> StepInputs:
        """Allocate the chunks' blocks and build the flattened varlen batch for them."""
        ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        sampled: list[Sequence] = []
        num_decode = num_prefill = 0
        for chunk in chunks:
            seq = chunk.seq
            assert isinstance(seq, Sequence)
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
        attn = self.builder.build([(chunk.seq.table, chunk.num_new) for chunk in chunks])
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
    def execute(self, inputs: StepInputs, generators: list[torch.Generator | None]
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

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], generators: list[torch.Generator | None]
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
