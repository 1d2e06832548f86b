"""Decode steps through CUDA graphs: one graph per batch-size bucket, replayed over static step buffers.

An eager decode step on a GPU is bound by the host launching its kernels (the first H200 run measured
5-11 ms a step where the step's bytes take 0.07-0.25 ms). A graph captured once per bucket replays
all of the forward's launches in one call. A decode-only step of B sequences (one new token each, one
logits row each) copies its inputs into the first B rows of the static buffers, pads the rows up to
the bucket (token 0 at position 0, no K/V write, a one-token context in block 0: read, never
written), replays the bucket's graph and returns the first B rows of its logits.

Why the padded rows change nothing: every kernel of the step is batch invariant (the attention
kernel, the linear layers' matmuls: `helexa.kernels.linear`, the quantized matmuls), so a row's logits
are the same bits in a bucket of 64 as alone; and the attention's splits past a sequence's keys are
empty partials the fold leaves out, so the static table width (the longest context) changes nothing
either. Any other step (a prefill or mixed batch, more sequences than the largest bucket, tensor
parallelism) runs eagerly, as does every step after a capture fails (logged once).

`capture` is injectable: `cuda_capture` on a GPU; the CPU tests pass one that replays by calling the
forward again, which exercises everything here but the graph itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from helexa.kvcache.metadata import AttentionMetadata
from helexa.values import debug_enabled

__all__ = ["DecodeGraphs", "buckets_for", "cuda_capture"]

logger = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor], torch.Tensor]
# capture(run) -> (replay, output): `run()` computes the step into its output tensor; `replay()` recomputes
# it into that same tensor (a graph's replay on CUDA).
Capture = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]


def buckets_for(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes a graph is captured for: 1, 2, 4, 8, then every multiple of 8 up to 64, then of 32,
    up to `max_num_seqs` (the last bucket is `max_num_seqs` itself). A step of B sequences replays the
    smallest bucket >= B: it computes fewer than B padded rows up to 8 sequences, at most 7 up to 64 and
    at most 31 past that."""
    sizes = [1, 2, 4, 8, *range(16, 65, 8), *range(96, max(96, max_num_seqs) + 1, 32)]
    chosen = sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs})
    return tuple(chosen)


def cuda_capture(run: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
    """Capture `run` in a CUDA graph after one warm-up on a side stream (Triton compiles, the caching
    allocator settles). Returns the graph's replay and the output tensor it writes."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    return graph.replay, out


@dataclass
class _Graph:
    replay: Callable[[], None]
    logits: torch.Tensor  # (bucket, V) written by each replay


class DecodeGraphs:
    """The decode forward of one model and pool, replayed from graphs per bucket (see the module docstring).

    `forward(input_ids, positions, attn, logits_indices) -> (S, V)` is the eager forward; `max_num_seqs`
    and `width` (the block tables' width: the longest context's blocks, of `block_size` tokens) size the
    static buffers on `device`. Not thread-safe (the engine's loop calls it)."""

    def __init__(
        self,
        forward: Forward,
        device: torch.device,
        max_num_seqs: int,
        width: int,
        block_size: int,
        *,
        capture: Capture = cuda_capture,
    ) -> None:
        self._forward, self._capture = forward, capture
        self.buckets = buckets_for(max_num_seqs)
        self.width, self.block_size = width, block_size
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)  # (N,)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)  # (N,)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)  # (N,) -1: no write
        self.block_tables = torch.zeros((n, width), dtype=torch.int32, device=device)  # (N, W)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)  # (N,)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # (N+1,) one token each
        self.logits_rows = torch.arange(n, dtype=torch.long, device=device)  # (N,) one logits row each
        self._graphs: dict[int, _Graph] = {}
        self.disabled: str | None = None  # why graphs are off (a capture failed), else None
        self.replays = 0

    def eligible(self, input_ids: torch.Tensor, attn: AttentionMetadata, logits_indices: torch.Tensor) -> bool:
        """A decode-only step this can replay: one new token and one logits row per sequence, at most the
        largest bucket of sequences, tables no wider than the static ones."""
        b = attn.num_seqs
        return (
            self.disabled is None
            and 0 < b <= self.buckets[-1]
            and attn.num_tokens == b == input_ids.shape[0] == logits_indices.shape[0]
            and attn.block_tables.shape[1] <= self.width
        )

    def bucket(self, num_seqs: int) -> int:
        """The smallest bucket holding `num_seqs` sequences."""
        return next(b for b in self.buckets if b >= num_seqs)

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata, logits_indices: torch.Tensor
    ) -> torch.Tensor | None:
        """The step's (B, V) logits from its bucket's graph (captured on first use), or None when the step
        is not eligible or graphs are disabled: the caller runs it eagerly."""
        if not self.eligible(input_ids, attn, logits_indices):
            return None
        b = attn.num_seqs
        size = self.bucket(b)
        self._fill(input_ids, positions, attn, logits_indices, size)
        graph = self._graphs.get(size)
        if graph is None:
            try:
                graph = self._graphs[size] = self._capture_bucket(size)
            except Exception as exc:  # the eager path still works: serve without graphs
                self.disabled = f"{type(exc).__name__}: {exc}"
                logger.warning("engine: CUDA graph capture failed (%s); running every step eagerly", self.disabled)
                return None
        graph.replay()
        self.replays += 1
        return graph.logits[:b]

    def _fill(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        logits_indices: torch.Tensor,
        size: int,
    ) -> None:
        """The step's rows into the static buffers; rows [B, size) padded (see the module docstring)."""
        b, w = attn.num_seqs, attn.block_tables.shape[1]
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.slot_mapping[:b].copy_(attn.slot_mapping)
        self.block_tables[:b, :w].copy_(attn.block_tables)
        self.seq_lens[:b].copy_(attn.seq_lens)
        if size > b:
            self.input_ids[b:size].zero_()
            self.positions[b:size].zero_()
            self.slot_mapping[b:size].fill_(-1)
            self.block_tables[b:size].zero_()
            self.seq_lens[b:size].fill_(1)
        if debug_enabled() and not torch.equal(logits_indices.long(), self.logits_rows[:b]):  # a host sync
            raise AssertionError("a decode step's logits rows must be its sequences in order")

    def _capture_bucket(self, size: int) -> _Graph:
        attn = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            max_query_len=1,
            max_seq_len=self.width * self.block_size,
        )

        def run() -> torch.Tensor:
            return self._forward(self.input_ids[:size], self.positions[:size], attn, self.logits_rows[:size])

        replay, logits = self._capture(run)
        logger.info("engine: captured the decode graph for %d sequences", size)
        return _Graph(replay, logits)
