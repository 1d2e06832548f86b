"""A tensor-parallel worker process (ranks 1..N-1): load a shard, agree on the pool, run every step.

The worker does what rank 0 does for a load — its shard of the weights (only its slices read),
its own block count from its own totals, the agreed minimum, a pool of exactly that many blocks —
and then runs, step after step, the same forward as rank 0 over the inputs rank 0 broadcasts.
It schedules, samples and streams nothing. Any exception is reported to rank 0 (its text) and ends
the process; rank 0 then treats the whole group as faulted.

It runs in a fresh interpreter that rank 0 starts (`group._start_worker`): the bootstrap there has
already ignored SIGINT and started the lifeline thread, set rank 0's `sys.path`, and then calls `main`.
Nothing of rank 0's `__main__` is imported here.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
import traceback
from multiprocessing.connection import Connection

import torch

from helexa.engine.parallel.group import WorkerSpec, all_reduce_min, destroy_group, init_group, rank_device

__all__ = ["main"]


def main(rank: int, spec_bytes: bytes, report_fd: int) -> None:
    """Serve as rank `rank` until rank 0 sends STOP (exit status 0) or closes the lifeline (the bootstrap's
    thread exits the process). `spec_bytes` is the pickled `WorkerSpec`; `report_fd` the report pipe.

    Reports `("ready", num_blocks)` once its shard is loaded and its own block count known, or
    `("error", "Type: message")` before it exits on any exception (exit status 1).
    """
    report = Connection(report_fd, readable=False)
    try:
        spec: WorkerSpec = pickle.loads(spec_bytes)
        torch.set_num_threads(max(1, spec.threads))
        _serve(spec, rank, report)
    except BaseException as exc:  # noqa: BLE001 — everything is reported, then the process ends
        text = f"{type(exc).__name__}: {exc}"
        try:
            report.send(("error", text))
        except OSError:
            pass
        print(f"helexa tensor-parallel rank {rank}: {text}\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        os._exit(1)
    destroy_group()
    os._exit(0)


def _serve(spec: WorkerSpec, rank: int, report: Connection) -> None:
    from helexa.engine.loading import load_shard  # heavy: only in the worker process
    from helexa.engine.parallel.step import StepChannel
    from helexa.kvcache import BlockPool

    device = rank_device(torch.device(spec.device_type), rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model, budget = load_shard(
        spec.config, spec.model_dir, spec.dtype, device, spec.max_model_len, rank=rank, size=spec.size
    )
    report.send(("ready", budget.num_blocks))
    init_group(spec, rank)
    agreed = all_reduce_min([budget.num_blocks])[0]
    plan = model.plan
    # The KV cache is in the model dtype (fp8 KV is refused with tensor parallelism).
    pool = BlockPool(
        agreed, spec.config.block_size, model.config.num_hidden_layers, plan.num_kv_heads, plan.head_dim,
        spec.dtype, device,
    )  # fmt: skip
    if pool.num_blocks != agreed:
        raise RuntimeError(f"rank {rank} allocated {pool.num_blocks} KV blocks, not the agreed {agreed}")
    all_reduce_min([pool.num_blocks, -pool.num_blocks])  # rank 0's `confirm`
    kv_caches = pool.kv_caches()
    channel = StepChannel(spec.capacity, device if spec.backend == "nccl" else torch.device("cpu"))
    faults = set(spec.fault_steps) if spec.fault_rank == rank else set()
    with torch.inference_mode():
        while (step := channel.recv()) is not None:
            if step.step_no in faults:
                faults.discard(step.step_no)
                if spec.fault_mode == "hang":
                    while True:  # stops answering: rank 0's step timeout fires, then the lifeline ends us
                        time.sleep(3600)
                raise RuntimeError(
                    f"injected device fault at engine step {step.step_no} on tensor-parallel rank {rank} "
                    "(HELEXA_FAULT_INJECT, HELEXA_FAULT_INJECT_RANK)"
                )
            model(step.input_ids, step.positions, step.attn, kv_caches, step.logits_indices)
