"""Each step's model inputs, packed into one int64 tensor and broadcast from rank 0 to the workers.

Layout of the buffer (`HEADER` ints, then the body, all int64):

    [cmd, step_no, T, B, W, S, max_query_len, max_seq_len] ++ input_ids (T) ++ positions (T)
    ++ slot_mapping (T) ++ seq_lens (B) ++ query_start_loc (B+1) ++ logits_indices (S)
    ++ block_tables (B*W, row-major)

Every rank holds a buffer of the same capacity, so a step is exactly one `broadcast` of tensors
(no pickling). A step larger than the capacity is preceded by one `RESIZE` broadcast that makes every
rank grow its buffer (to at least double), so the extra broadcast happens a handful of times per
load at most. `STOP` ends a worker's loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from helexa.kvcache.metadata import AttentionMetadata

__all__ = ["HEADER", "StepChannel", "StepTensors", "initial_capacity"]

HEADER = 8
CMD_STEP, CMD_STOP, CMD_RESIZE = 1, 2, 3


def initial_capacity(max_num_batched_tokens: int, max_num_seqs: int, blocks_per_seq: int = 16) -> int:
    """The buffer size every rank starts with: a full step of `max_num_batched_tokens` tokens over
    `max_num_seqs` sequences of up to `blocks_per_seq` blocks each (longer tables grow it)."""
    b = min(max_num_seqs, max_num_batched_tokens)
    return HEADER + 3 * max_num_batched_tokens + 3 * b + 1 + b * blocks_per_seq


@dataclass(frozen=True)
class StepTensors:
    """One step's inputs as a worker unpacks them (views into the channel's buffer, valid until the next `recv`)."""

    step_no: int
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # (S,) int64


class StepChannel:
    """The step broadcast over the default process group; rank 0 `send`s, the workers `recv`.

    `device`: where the buffer lives (the group's: CPU for gloo, the rank's GPU for NCCL). Rank 0
    never waits for the device to pack: the header's ints are host values and the body is one
    `torch.cat` into the buffer.
    """

    def __init__(self, capacity: int, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.buffer = torch.zeros(capacity, dtype=torch.int64, device=self.device)  # (capacity,)
        self.broadcasts = 0  # collectives issued (steps + resizes + stop), for tests and benchmarks

    @property
    def capacity(self) -> int:
        return int(self.buffer.shape[0])

    def send(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        logits_indices: torch.Tensor,
        step_no: int = 0,
    ) -> None:
        """Broadcast one step (rank 0): input_ids, positions (T,) int64; attn: the step's metadata (its
        tensors on this rank's device); logits_indices (S,) int64; `step_no` the engine step (0: not one)."""
        t, b = int(input_ids.shape[0]), attn.num_seqs
        w, s = int(attn.block_tables.shape[1]), int(logits_indices.shape[0])
        n = HEADER + 3 * t + 2 * b + 1 + s + b * w
        if n > self.capacity:
            self._resize(max(n, 2 * self.capacity))
        header = torch.tensor(
            [CMD_STEP, step_no, t, b, w, s, attn.max_query_len, attn.max_seq_len], dtype=torch.int64
        ).to(self.device, non_blocking=True)
        pieces = [
            header,
            input_ids,
            positions,
            attn.slot_mapping,
            attn.seq_lens.to(torch.int64),
            attn.query_start_loc.to(torch.int64),
            logits_indices,
            attn.block_tables.to(torch.int64).reshape(-1),
        ]
        torch.cat(pieces, out=self.buffer[:n])
        self._broadcast()

    def send_stop(self) -> None:
        """Tell every worker to leave its loop (rank 0)."""
        self.buffer[:2] = torch.tensor([CMD_STOP, 0], dtype=torch.int64)
        self._broadcast()

    def recv(self) -> StepTensors | None:
        """The next step's inputs (a worker), None when rank 0 sent `STOP`. Blocks until rank 0 sends;
        raises if the group breaks (a rank died, or the group's timeout passed)."""
        while True:
            self._broadcast()
            cmd, step_no, t, b, w, s, max_q, max_s = self.buffer[:HEADER].tolist()
            if cmd == CMD_STOP:
                return None
            if cmd == CMD_RESIZE:
                self.buffer = torch.zeros(t, dtype=torch.int64, device=self.device)
                continue
            if cmd != CMD_STEP:
                raise RuntimeError(f"step channel: unknown command {cmd} (the ranks are out of step)")
            sizes = [t, t, t, b, b + 1, s, b * w]
            ids, pos, slots, seq_lens, qsl, rows, tables = self.buffer[HEADER : HEADER + sum(sizes)].split(sizes)
            attn = AttentionMetadata(
                slot_mapping=slots,
                block_tables=tables.reshape(b, w).to(torch.int32),
                seq_lens=seq_lens.to(torch.int32),
                query_start_loc=qsl.to(torch.int32),
                max_query_len=max_q,
                max_seq_len=max_s,
            )
            return StepTensors(step_no, ids, pos, attn, rows)

    def _resize(self, capacity: int) -> None:
        self.buffer[:3] = torch.tensor([CMD_RESIZE, 0, capacity], dtype=torch.int64)
        self._broadcast()
        self.buffer = torch.zeros(capacity, dtype=torch.int64, device=self.device)

    def _broadcast(self) -> None:
        dist.broadcast(self.buffer, src=0)
        self.broadcasts += 1
