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

from helexa.engine.cuda_graphs import Capture, DecodeGraphs, cuda_capture
from helexa.engine.loading import LoadedModel, to_device
from helexa.engine.scheduler import ScheduledChunk
from helexa.engine.sequence import Sequence
from helexa.kvcache import AttentionMetadata, BatchBuilder, BlockTable
from helexa.model.quant import native
from helexa.model.sampling import Sampler, SampleResult
from helexa.model.sampling.bitmask import allocate_bitmask


@dataclass(slots=True)  # built per sequence per step: not frozen (a frozen __init__ costs ~3x)
class SampleGroup:
    """One sequence's sampling rows in a step: rows `row .. row + len(draft)` of the step's samples. Row `row`
    follows the sequence's last known token; row `row + j` follows draft token `j` (a speculative draft,
    verified this step: `draft` is () for a plain decode or a prefill's last chunk)."""

    seq: Sequence
    row: int
    draft: tuple[int, ...] = ()

    @property
    def num_rows(self) -> int:
        return 1 + len(self.draft)


@dataclass(frozen=True)
class StepInputs:
    """Everything one forward needs, built once per step (never per layer)."""

    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # (S,) int64 — rows of the flattened batch sampled from their logits
    groups: list[SampleGroup]  # the sequences that sample (their rows add up to S + A)
    num_decode_tokens: int  # tokens of sequences past their prompt (draft tokens included)
    num_prefill_tokens: int
    num_decode_seqs: int = 0  # sequences past their prompt
    # (A,) int64 — rows of the flattened batch whose token is their logits' argmax and who need nothing else of
    # them (`takes_argmax`): the fused CPU step returns their tokens, never their logits. Samples' rows S .. S + A.
    argmax_indices: torch.Tensor | None = None

    @property
    def num_draft_tokens(self) -> int:
        """Speculative draft tokens the step verifies: decode tokens beyond each decoding sequence's own."""
        return self.num_decode_tokens - self.num_decode_seqs


@dataclass(frozen=True)
class StepSamples:
    """A step's sampling: one token per row (`samples`), and per group how many of its rows are `emitted`: all
    rows up to and including the first whose token differs from the draft (1 + the draft tokens kept).
    `failures`: groups (by index) whose own parameters broke sampling, with the error; they emit nothing."""

    samples: SampleResult
    emitted: list[int]
    failures: dict[int, Exception]


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
        self.sampler = Sampler(native=self.device.type == "cpu" and native.available())
        self._kv_caches = loaded.pool.kv_caches()
        self.graphs: DecodeGraphs | None = None  # `use_cuda_graphs`: decode steps replayed from CUDA graphs

    @property
    def argmax_in_step(self) -> bool:
        """Whether the forward itself takes the tokens of rows that want only their argmax (`takes_argmax`): on
        the fused CPU step (no tensor parallelism, no CUDA graphs), whose head then never stores their logits."""
        return self.group is None and self.graphs is None and getattr(self.model, "native_step", None) is not None

    def use_cuda_graphs(self, max_num_seqs: int, max_model_len: int, capture: Capture = cuda_capture) -> None:
        """Replay decode-only steps from CUDA graphs (`helexa.engine.cuda_graphs`), captured per batch-size
        bucket on first use, over tables as wide as `max_model_len`; other steps stay eager. Not under
        tensor parallelism (the workers run the step too). `capture` is for tests off CUDA."""
        if self.group is not None:
            return
        width = -(-max_model_len // self.pool.block_size)
        self.graphs = DecodeGraphs(self._eager_forward, self.device, max_num_seqs, width, self.pool.block_size,
                                   capture=capture)  # fmt: skip

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
        argmax_indices: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model over one step's inputs on the pool: (S, V) float32 logits of rows `logits_indices`, and
        the tokens (A,) int64 of rows `argmax_indices` (None when not given), which only the fused CPU step
        takes (`argmax_in_step`: their argmax over the tokenizer's columns, their logits never stored).
        Tensor-parallel: the inputs go to the workers in one broadcast first, and every rank runs its shard.
        A decode step replays its bucket's CUDA graph when `use_cuda_graphs` is on (the same bits as eagerly)."""
        if argmax_indices is not None:
            return self.model.forward_rows(
                input_ids, positions, attn, self._kv_caches, logits_indices, argmax_indices,
                self.sample_vocab_size, reuse_logits=True,
            )  # fmt: skip
        if self.graphs is not None:
            logits = self.graphs.run(input_ids, positions, attn, logits_indices)
            if logits is not None:
                return logits, None
        if self.group is None:
            return self._eager_forward(input_ids, positions, attn, logits_indices), None
        return self.group.run(
            lambda: self.model(input_ids, positions, attn, self._kv_caches, logits_indices),
            input_ids, positions, attn, logits_indices, step_no,
        ), None  # fmt: skip

    def _eager_forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata, logits_indices: torch.Tensor
    ) -> torch.Tensor:
        # A step's logits are sampled (to host lists) before the next step runs: they may share one buffer.
        return self.model(input_ids, positions, attn, self._kv_caches, logits_indices, reuse_logits=True)

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
        last = 4 if self.graphs is not None else 3  # a warm-up table ends with 3 tokens (4: a capture step too)
        per_table = -(-last // pool.block_size)
        k = min(decode_seqs, builder.max_num_seqs, pool.num_free_blocks // per_table)
        if k < 1 or builder.max_model_len < last:
            return None
        tables = [builder.new_table() for _ in range(k)]
        try:
            self._time_forward(builder, [(tables[0], 2)] + [(t, 1) for t in tables[1:]])  # warm-up, prefill too
            if self.graphs is not None:  # the decode bucket's graph is captured here, not in the timed step
                self._time_forward(builder, [(t, 1) for t in tables])
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
        if self.argmax_in_step:  # greedy rows, as the step takes them
            _, tokens = self._forward(packed[:t], packed[t : 2 * t], attn, packed[:0], argmax_indices=packed[2 * t :])
        else:
            tokens = self._forward(packed[:t], packed[t : 2 * t], attn, packed[2 * t :])[0].argmax(dim=-1)
        assert tokens is not None
        tokens.tolist()  # (B,): the one host transfer a step ends with
        return time.perf_counter() - start

    def prepare(self, chunks: list[ScheduledChunk[Sequence]], attn: AttentionMetadata) -> StepInputs:
        """The flattened varlen batch of the chunks, over `attn` (the KV owner's tables for them, in chunk order)."""
        ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []  # rows sampled from their logits
        argmax_rows: list[int] = []  # rows that take their argmax in the step (samples after sample_rows')
        argmax_groups: list[tuple[SampleGroup, int]] = []  # and their groups, with their index in argmax_rows
        groups: list[SampleGroup] = []
        num_decode = num_prefill = num_decode_seqs = 0
        in_step = self.argmax_in_step
        for chunk in chunks:
            seq, draft = chunk.seq, chunk.draft
            start = seq.num_computed
            ids.extend(seq.token_ids[start : start + chunk.num_new - len(draft)])
            ids.extend(draft)  # (a draft follows the last known token: num_new = 1 + len(draft))
            positions.extend(range(start, start + chunk.num_new))
            if chunk.samples:
                step_rows = range(len(ids) - 1 - len(draft), len(ids))
                if in_step and seq.params.takes_argmax:
                    argmax_groups.append((group := SampleGroup(seq, 0, draft), len(argmax_rows)))
                    argmax_rows.extend(step_rows)
                else:
                    group = SampleGroup(seq, len(sample_rows), draft)
                    sample_rows.extend(step_rows)
                groups.append(group)
            if seq.in_prefill:
                num_prefill += chunk.num_new
            else:
                num_decode += chunk.num_new
                num_decode_seqs += 1
        for group, first in argmax_groups:  # their samples follow the sampled rows'
            group.row = len(sample_rows) + first
        packed = to_device(ids + positions + sample_rows + argmax_rows, self.device)  # (2T + S + A,): one transfer
        num_tokens, sampled_end = len(ids), 2 * len(ids) + len(sample_rows)
        return StepInputs(
            input_ids=packed[:num_tokens],
            positions=packed[num_tokens : 2 * num_tokens],
            attn=attn,
            logits_indices=packed[2 * num_tokens : sampled_end],
            groups=groups,
            num_decode_tokens=num_decode,
            num_prefill_tokens=num_prefill,
            num_decode_seqs=num_decode_seqs,
            argmax_indices=packed[sampled_end:] if argmax_rows else None,
        )

    @torch.inference_mode()
    def execute(self, inputs: StepInputs, step_no: int = 0) -> StepSamples | None:
        """Run the forward over the batch, sample one token for each sampling row and verify each draft.

        A group's rows are sampled as its plain decode steps would sample them one after another: row j
        sees the draft's first j tokens as output (penalties, the grammar's mask), and a seeded row draws
        from the request's generator in row order. The group emits its rows up to and including the
        first whose token differs from the draft; its generator is then left exactly as far on as
        those emitted draws, so the tokens are the ones decoding without a draft gives (greedy and
        seeded alike), and an unseeded row's token is drawn from the same distribution.

        None when no row samples. A failure one request's parameters cause is that request's (in
        `failures`), never a device fault. Exceptions from the forward propagate (under tensor
        parallelism a `TensorParallelFault` naming the rank). `step_no`: the engine step, for the
        workers' fault injection (0: not an engine step).
        """
        logits, tokens = self._forward(  # tokens (A,): the argmax rows', taken in the step
            inputs.input_ids, inputs.positions, inputs.attn, inputs.logits_indices, step_no, inputs.argmax_indices
        )
        if not inputs.groups:
            return None
        if self.sample_vocab_size is not None and self.sample_vocab_size < logits.shape[1]:
            logits = logits[:, : self.sample_vocab_size]  # (S, V_tokenizer)
        s = logits.shape[0]  # the groups whose rows are sampled from logits come first, in order
        rows = [
            _Row(g.seq, g.draft[:j], gi) for gi, g in enumerate(inputs.groups) if g.row < s for j in range(g.num_rows)
        ]
        bitmask = None  # structured output: the tokens each row may sample (the sampler masks after logprobs)
        if any(g.seq.constraint is not None for g in inputs.groups):
            width = max(logits.shape[1], *(g.seq.constraint.vocab_size for g in inputs.groups if g.seq.constraint))
            bitmask = allocate_bitmask(len(rows), width)  # (S, ceil(width / 32)) int32 on the host, all allowed
            for g in inputs.groups:
                if g.seq.constraint is not None:
                    g.seq.constraint.fill_ahead(bitmask, g.row, g.draft)
        # A seeded group with a draft draws one number per row; it keeps only the draws of the rows it emits.
        rewind = {
            gi: (g.seq.generator, g.seq.generator.get_state())
            for gi, g in enumerate(inputs.groups)
            if g.draft and g.seq.generator is not None and not g.seq.params.is_greedy
        }
        samples, failures = self._sample_rows(logits, rows, bitmask) if rows else (SampleResult([], [], []), {})
        if tokens is not None:
            none = [None] * tokens.shape[0]
            samples = SampleResult(
                samples.token_ids + tokens.tolist(), [*samples.logprobs, *none], [*samples.top_logprobs, *none]
            )
        emitted = [0 if gi in failures else _emitted(g, samples) for gi, g in enumerate(inputs.groups)]
        for gi, (generator, state) in rewind.items():
            _advance(generator, state, emitted[gi])
        return StepSamples(samples, emitted, failures)

    def _sample_rows(
        self, logits: torch.Tensor, rows: list[_Row], bitmask: torch.Tensor | None
    ) -> tuple[SampleResult, dict[int, Exception]]:
        """One vectorised call over every row; if it raises, the groups whose parameters cause it are found
        (their rows alone) and the others sampled again in one call."""
        try:
            return self._sample(logits, rows, bitmask), {}
        except Exception:
            failures: dict[int, Exception] = {}
            for group in sorted({r.group for r in rows}):
                mine = [i for i, r in enumerate(rows) if r.group == group]
                try:
                    self._sample(logits[mine], [rows[i] for i in mine], None if bitmask is None else bitmask[mine])
                except Exception as exc:
                    failures[group] = exc
            if not failures:
                raise
            ok = [i for i, r in enumerate(rows) if r.group not in failures]
            merged = SampleResult([-1] * len(rows), [None] * len(rows), [None] * len(rows))
            if ok:
                partial = self._sample(logits[ok], [rows[i] for i in ok], None if bitmask is None else bitmask[ok])
                for j, i in enumerate(ok):
                    merged.token_ids[i] = partial.token_ids[j]
                    merged.logprobs[i] = partial.logprobs[j]
                    merged.top_logprobs[i] = partial.top_logprobs[j]
            return merged, failures

    def _sample(self, logits: torch.Tensor, rows: list[_Row], bitmask: torch.Tensor | None = None) -> SampleResult:
        need_history = any(r.seq.params.uses_penalties for r in rows)
        return self.sampler.sample(
            logits,
            [r.seq.params for r in rows],
            [r.seq.generator for r in rows],
            prompt_ids=[r.seq.prompt_array for r in rows] if need_history else None,
            output_ids=[r.seq.output_ids + list(r.ahead) for r in rows] if need_history else None,
            bitmask=bitmask,
        )


@dataclass(slots=True)  # built per sampled row per step: not frozen (a frozen __init__ costs ~3x)
class _Row:
    """One sampling row: its sequence, the draft tokens before it, and its group's index."""

    seq: Sequence
    ahead: tuple[int, ...]
    group: int


def _emitted(group: SampleGroup, samples: SampleResult) -> int:
    """Rows the group emits: up to and including the first whose sampled token is not the draft's next."""
    kept = 0
    for j, token in enumerate(group.draft):
        if samples.token_ids[group.row + j] != token:
            break
        kept += 1
    return kept + 1


def _advance(generator: torch.Generator, state: torch.Tensor, draws: int) -> None:
    """Put `generator` back to `state`, then on by `draws` draws of one number each (the sampler's per-row draw)."""
    generator.set_state(state)
    scratch = torch.empty(1, device=generator.device)
    for _ in range(draws):
        scratch.uniform_(generator=generator)
