"""The tensor-parallel group as rank 0 (the engine process) sees it: spawn, agree, step, tear down.

    group = TensorParallelGroup.spawn(spec)      # N-1 workers start loading their shards
    ... rank 0 loads its own shard and computes its block count ...
    agreed = group.agree(own_blocks)             # wait for every worker, join the group, all_reduce MIN
    group.confirm(pool.num_blocks)               # every rank allocated exactly `agreed`
    logits = group.run(lambda: model(...), inputs...)   # one broadcast of the step, then the forward
    group.close()                                # workers stopped and reaped

One `torch.distributed` process group: NCCL on CUDA, gloo on CPU. It is set up the standard way,
from `MASTER_ADDR` / `MASTER_PORT` (default: 127.0.0.1 and a free port; a new one at each rebuild),
with `RANK`, `WORLD_SIZE` and `LOCAL_RANK` in every worker's environment, so a launcher can place
ranks elsewhere later. The group's timeout is `--step-timeout-secs`: a rank that does not answer
within it fails the collective on rank 0.

Workers are fresh interpreters (`sys.executable -c`, a short bootstrap that runs
`helexa.engine.parallel.worker`), not `multiprocessing` children: multiprocessing's `spawn` re-runs the
parent's `__main__` in every child, which breaks a script without an `if __name__ == "__main__":` guard
and code read from stdin (`python -`). A worker imports helexa (with rank 0's `sys.path`) and nothing of
the user's. It reads its `WorkerSpec` (pickled) from its stdin, gets `RANK`, `LOCAL_RANK`, `WORLD_SIZE`,
`MASTER_ADDR` and `MASTER_PORT` in its environment from the start, and has two pipes to rank 0: a report
pipe (ready with its block count, or the text of the exception that ended it) and a lifeline that rank 0
never writes: when it closes — `close()`, or rank 0's death, even by SIGKILL — the worker exits at once,
whatever its main thread is doing. So no worker outlives the engine process, and a hung worker is still
stopped. Its stderr passes through rank 0 (forwarded line by line to rank 0's `sys.stderr`), which keeps
the last lines: a worker that dies without a report (it could not start, or crashed) is described with them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from helexa.config import EngineConfig
from helexa.engine.parallel.step import StepChannel
from helexa.kvcache.metadata import AttentionMetadata
from helexa.model.config import ModelConfig
from helexa.model.parallel.comm import TensorParallel
from helexa.model.parallel.sharding import ShardPlan

__all__ = [
    "LOAD_TIMEOUT_SECS",
    "TensorParallelFault",
    "TensorParallelGroup",
    "WorkerSpec",
    "all_reduce_min",
    "destroy_group",
    "fault_injection",
    "free_port",
    "group_address",
    "init_group",
    "rank_device",
]

logger = logging.getLogger("helexa.parallel")

LOAD_TIMEOUT_SECS = 1800.0  # the longest a worker may take to load its shard before rank 0 gives up
_JOIN_SECS = 5.0  # how long a stopped worker may take to exit before it is killed
_STDERR_LINES = 20  # the last lines of a worker's stderr kept to describe its death
T = TypeVar("T")

# A worker's first instructions, before it imports anything of helexa or torch (argv: the report and
# lifeline fds, then the worker's name for `ps`). Ctrl-C reaches the whole process group: rank 0 drives
# the shutdown, so SIGINT is ignored; the lifeline thread exits the process when rank 0 closes the pipe
# or dies. Then stdin gives rank 0's sys.path and the pickled spec, and the worker module takes over.
_BOOTSTRAP = """\
import os, pickle, signal, sys, threading
from multiprocessing.connection import Connection
signal.signal(signal.SIGINT, signal.SIG_IGN)
report_fd, lifeline_fd = int(sys.argv[1]), int(sys.argv[2])
os.set_inheritable(report_fd, False)
os.set_inheritable(lifeline_fd, False)
def lifeline():
    try:
        while os.read(lifeline_fd, 64):
            pass
    except OSError:
        pass
    os._exit(0)
threading.Thread(target=lifeline, name="lifeline", daemon=True).start()
boot = pickle.load(sys.stdin.buffer)
sys.stdin.close()
sys.path[:] = boot["sys_path"]
try:
    from helexa.engine.parallel.worker import main
except BaseException as exc:
    Connection(report_fd, readable=False).send(("error", f"cannot import the worker: {type(exc).__name__}: {exc}"))
    raise
main(boot["rank"], boot["spec"], report_fd)
"""


class TensorParallelFault(RuntimeError):
    """A rank failed (an exception, its death, or no answer within the step timeout); the message says
    which rank and why. The whole group is then torn down and rebuilt, as for a device fault."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago (bound to port 0 and released)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def group_address() -> tuple[str, int]:
    """`(MASTER_ADDR, MASTER_PORT)` from the environment; by default 127.0.0.1 and a free port."""
    addr = os.environ.get("MASTER_ADDR") or "127.0.0.1"
    port = os.environ.get("MASTER_PORT")
    if port is None or not port.strip():
        return addr, free_port(addr)
    if not port.strip().isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"MASTER_PORT must be a port number, got {port!r}")
    return addr, int(port)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device of `rank` when rank 0 runs on `device`: the same CPU, or GPU `rank` of this host."""
    return torch.device("cuda", rank) if device.type == "cuda" else torch.device(device.type)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to load its shard and serve steps; pickled once, to its stdin, at spawn.

    `config` is the engine's; `fault_steps` / `fault_mode` are the
    test hook (`HELEXA_FAULT_INJECT` with `HELEXA_FAULT_INJECT_RANK`): the rank that matches raises
    (`raise`) or stops answering (`hang`) at those engine steps.
    """

    config: EngineConfig
    model_dir: str
    dtype: torch.dtype
    device_type: str
    max_model_len: int
    size: int
    addr: str
    port: int
    timeout_secs: float
    capacity: int
    threads: int = 1
    fault_rank: int = 0
    fault_steps: tuple[int, ...] = ()
    fault_mode: str = "raise"
    env: dict[str, str] = field(default_factory=dict)

    @property
    def backend(self) -> str:
        return "nccl" if self.device_type == "cuda" else "gloo"


def fault_injection(size: int) -> tuple[int, tuple[int, ...], str]:
    """The test hook's `(rank, steps, mode)`: `HELEXA_FAULT_INJECT` lists engine steps (as for one
    device), `HELEXA_FAULT_INJECT_RANK` (default 0, the engine) the rank they happen on, and
    `HELEXA_FAULT_INJECT_MODE` what a worker rank does there: `raise` (default) or `hang`.
    `ValueError` for a malformed value, so a typo never silently disables a test."""
    from helexa.engine.faults import FaultInjector

    steps = tuple(sorted(FaultInjector.from_env().pending))
    rank_text = os.environ.get("HELEXA_FAULT_INJECT_RANK", "0").strip() or "0"
    if not rank_text.isdigit() or int(rank_text) >= size:
        raise ValueError(f"HELEXA_FAULT_INJECT_RANK must be a rank in [0, {size}), got {rank_text!r}")
    mode = os.environ.get("HELEXA_FAULT_INJECT_MODE", "raise").strip() or "raise"
    if mode not in ("raise", "hang"):
        raise ValueError(f"HELEXA_FAULT_INJECT_MODE must be raise or hang, got {mode!r}")
    return int(rank_text), steps, mode


def init_group(spec: WorkerSpec, rank: int) -> None:
    """Join the default process group as `rank` (rendezvous at `spec.addr:spec.port`, timeout `spec.timeout_secs`)."""
    if dist.is_initialized():
        raise RuntimeError(
            "a torch.distributed process group already exists in this process: one tensor-parallel engine "
            "per process (shut the other engine down first)"
        )
    if spec.backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ and spec.addr in ("127.0.0.1", "localhost"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # all ranks on this host: gloo's pairs over loopback
    dist.init_process_group(
        spec.backend,
        init_method=f"tcp://{spec.addr}:{spec.port}",
        rank=rank,
        world_size=spec.size,
        timeout=timedelta(seconds=spec.timeout_secs),
    )


def destroy_group(abort: bool = False) -> None:
    """Leave the default process group, if any; `abort` (after a fault, NCCL) aborts its communicators first."""
    if not dist.is_initialized():
        return
    with contextlib.suppress(Exception):
        if abort and dist.get_backend() == "nccl":
            dist.distributed_c10d._abort_process_group()
            return
        dist.destroy_process_group()


class WorkerProcess:
    """One worker rank's process as rank 0 holds it: its `Popen`, and the tail of its stderr, which a thread
    forwards line by line to rank 0's `sys.stderr`. Reads as a `multiprocessing.Process` does (`pid`,
    `exitcode` negative for a signal, `is_alive`, `join`, `kill`)."""

    def __init__(self, rank: int, popen: subprocess.Popen[bytes]) -> None:
        self.rank, self.popen = rank, popen
        self.tail: deque[str] = deque(maxlen=_STDERR_LINES)
        self._forwarder = threading.Thread(target=self._forward, name=f"helexa-tp{rank}-stderr", daemon=True)
        self._forwarder.start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.popen.kill()  # nothing once it has been reaped

    def stderr_tail(self) -> str:
        """The last lines the worker wrote to its stderr (all of them, once it has exited and they are read)."""
        if not self.is_alive():
            self._forwarder.join(timeout=1.0)  # a grandchild may hold the pipe open: do not wait for ever
        return "\n".join(self.tail)

    def _forward(self) -> None:
        stream = self.popen.stderr
        assert stream is not None
        with contextlib.suppress(Exception), stream:
            for raw in iter(stream.readline, b""):
                line = raw.decode(errors="replace")
                self.tail.append(line.rstrip("\n")[:500])
                with contextlib.suppress(Exception):
                    sys.stderr.write(line)
                    sys.stderr.flush()


def _start_worker(spec: WorkerSpec, rank: int) -> tuple[WorkerProcess, Connection, Connection]:
    """Start rank `rank` as a fresh interpreter (see the module docstring); returns it, the reading end of its
    report pipe and the writing end of its lifeline. The parent's `__main__` is never imported there."""
    report_r, report_w = os.pipe()
    life_r, life_w = os.pipe()
    env = {**os.environ, **spec.env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
    # -E, -s, -X ... as the parent runs with (what multiprocessing passes its children too)
    flags: list[str] = getattr(subprocess, "_args_from_interpreter_flags", list)()
    argv = [sys.executable, *flags, "-c", _BOOTSTRAP, str(report_w), str(life_r), f"helexa-tp{rank}"]
    try:
        try:
            popen = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stderr=subprocess.PIPE, env=env, pass_fds=(report_w, life_r)
            )
        except OSError as exc:
            os.close(report_r)
            os.close(life_w)
            raise ValueError(f"cannot start tensor-parallel rank {rank} ({sys.executable!r}): {exc}") from exc
    finally:
        os.close(report_w)  # the worker holds the writing end now: EOF here means it is gone
        os.close(life_r)
    worker = WorkerProcess(rank, popen)
    boot = {"sys_path": list(sys.path), "rank": rank, "spec": pickle.dumps(spec)}
    assert popen.stdin is not None
    with contextlib.suppress(OSError):  # it died at once: its exit (and stderr) is reported by `agree`
        with popen.stdin:
            popen.stdin.write(pickle.dumps(boot))
    return worker, Connection(report_r, writable=False), Connection(life_w, readable=False)


def _reap(procs: list[Any], lifelines: list[Connection]) -> None:
    """Close every lifeline (the workers exit), then wait for each worker and kill those that linger."""
    for conn in lifelines:
        with contextlib.suppress(OSError):
            conn.close()
    deadline = time.monotonic() + _JOIN_SECS
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=_JOIN_SECS)


class TensorParallelGroup:
    """Rank 0's handle on the workers and the process group (see the module docstring).

    Guarantees: after `close()` (or when this object is garbage collected, or the interpreter exits)
    every worker has exited and been reaped; `run` either returns rank 0's result or raises
    `TensorParallelFault` naming the rank at fault.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        plan: ShardPlan,
        procs: list[WorkerProcess],
        reports: list[Connection],
        lifelines: list[Connection],
    ) -> None:
        self.spec = spec
        self.procs, self.reports, self.lifelines = procs, reports, lifelines
        self.tp = TensorParallel(plan)  # rank 0's place in the group
        self.channel: StepChannel | None = None
        self.figures: list[int] = []
        self.agreed: int | None = None
        self.allocated: tuple[int, int] | None = None
        self._errors: dict[int, str] = {}
        self._closed = False
        self._finalizer = weakref.finalize(self, _reap, procs, lifelines)

    @property
    def size(self) -> int:
        return self.spec.size

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the worker ranks 1..N-1, in rank order."""
        return [int(p.pid) for p in self.procs]

    @classmethod
    def spawn(cls, spec: WorkerSpec, model_config: ModelConfig) -> TensorParallelGroup:
        """Start workers 1..N-1 (`spec.size` ranks in all) loading their shards; returns at once.
        `ValueError` (before anything starts) when `model_config` cannot be split over `spec.size` ranks."""
        plan = ShardPlan.for_model(model_config, 0, spec.size)
        procs: list[WorkerProcess] = []
        reports: list[Connection] = []
        lifelines: list[Connection] = []
        try:
            for rank in range(1, spec.size):
                proc, report, lifeline = _start_worker(spec, rank)
                procs.append(proc)
                reports.append(report)
                lifelines.append(lifeline)
        except BaseException:
            _reap(procs, lifelines)
            for conn in reports:
                conn.close()
            raise
        logger.info(
            "tensor parallel: spawned %d workers (pids %s) for %d ranks; group %s at %s:%d",
            len(procs), ",".join(str(p.pid) for p in procs), spec.size, spec.backend, spec.addr, spec.port,
        )  # fmt: skip
        return cls(spec, plan, procs, reports, lifelines)

    # ------------------------------------------------------------------ load: agreement on the block count

    def agree(self, own_blocks: int) -> int:
        """Wait for every worker's block count, join the group, and return the minimum over all ranks
        (an all_reduce MIN): the count every rank allocates. Logs one line with every rank's figure.
        Raises `ValueError` when a worker failed or died while loading."""
        figures = {0: own_blocks, **self._wait_ready()}
        init_group(self.spec, 0)
        self.channel = StepChannel(self.spec.capacity, rank_device(torch.device(self.spec.device_type), 0))
        agreed = all_reduce_min([own_blocks])[0]
        self.figures = [figures[r] for r in range(self.size)]
        if agreed != min(self.figures):
            raise TensorParallelFault(f"block-count agreement gave {agreed}, but the ranks reported {self.figures}")
        self.agreed = agreed
        logger.info(
            "kv budget: tensor_parallel=%d blocks per rank [%s] -> agreed %d (the minimum; every rank allocates it)",
            self.size, " ".join(f"r{r}={n}" for r, n in enumerate(self.figures)), agreed,
        )  # fmt: skip
        return agreed

    def confirm(self, num_blocks: int) -> None:
        """Check, across the group, that every rank allocated exactly the agreed count (`num_blocks` is rank 0's):
        `allocated` becomes the (smallest, largest) pool over the ranks. Every worker calls it once, after
        its allocation, so rank 0 calls it exactly once per load."""
        low, neg_high = all_reduce_min([num_blocks, -num_blocks])
        self.allocated = (low, -neg_high)
        if not low == -neg_high == num_blocks == self.agreed:
            raise TensorParallelFault(
                f"ranks allocated between {low} and {-neg_high} KV blocks; the agreed count is {self.agreed}"
            )

    def _wait_ready(self) -> dict[int, int]:
        """Each worker's block count, from its report pipe; a worker's error, death or timeout raises
        `ValueError` with its cause (the start fails as any load does: the server prints it and exits 1)."""
        ready: dict[int, int] = {}
        deadline = time.monotonic() + LOAD_TIMEOUT_SECS
        while len(ready) < len(self.procs):
            pending = [i for i in range(len(self.procs)) if i + 1 not in ready]
            left = deadline - time.monotonic()
            if left <= 0:
                raise ValueError(
                    f"tensor-parallel ranks {[i + 1 for i in pending]} did not load within {LOAD_TIMEOUT_SECS:g}s"
                )
            wait([self.reports[i] for i in pending], timeout=min(left, 1.0))  # a report, or EOF: the worker ended
            for i in pending:
                message = self._read_report(i)
                if message is not None and message[0] == "ready":
                    ready[i + 1] = int(message[1])
                elif not self.procs[i].is_alive() or message is not None:
                    raise ValueError(f"while loading: {self._describe(i + 1)}")
        return ready

    def _read_report(self, index: int) -> tuple[str, Any] | None:
        conn = self.reports[index]
        try:
            if not conn.poll():
                return None
            message = conn.recv()
        except (EOFError, OSError):
            return None
        if message[0] == "error":
            self._errors[index + 1] = str(message[1])
        return message

    # ------------------------------------------------------------------ steps

    def run(
        self,
        forward: Callable[[], T],
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        logits_indices: torch.Tensor,
        step_no: int = 0,
    ) -> T:
        """Broadcast the step's inputs to the workers, then run `forward()` (rank 0's shard of the same
        forward, whose collectives the workers join). Any failure — a dead worker (checked first, without
        a wait), a collective that failed or timed out, an exception on rank 0 — raises
        `TensorParallelFault` with the cause, the rank at fault first."""
        if self.channel is None or self._closed:
            raise TensorParallelFault("the tensor-parallel group is not running")
        dead = [r for r, p in enumerate(self.procs, 1) if not p.is_alive()]
        if dead:
            raise TensorParallelFault("; ".join(self._describe(r) for r in dead))
        try:
            self.channel.send(input_ids, positions, attn, logits_indices, step_no)
            return forward()
        except Exception as exc:
            raise TensorParallelFault(self._failure(exc)) from exc

    def _failure(self, exc: BaseException) -> str:
        """The cause of a failed step: what a worker reported or how it ended, else rank 0's own error."""
        deadline = time.monotonic() + 1.0  # a worker reports its exception just before it exits
        while time.monotonic() < deadline:
            for i in range(len(self.procs)):
                self._read_report(i)
            if self._errors or any(not p.is_alive() for p in self.procs):
                break
            time.sleep(0.01)
        failed = sorted(set(self._errors) | {r for r, p in enumerate(self.procs, 1) if not p.is_alive()})
        own = f"rank 0: {type(exc).__name__}: {exc}"
        if failed:
            return "; ".join(self._describe(r) for r in failed) + f" ({own})"
        if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
            return f"a rank did not answer within --step-timeout-secs {self.spec.timeout_secs:g} ({own})"
        return own

    def _describe(self, rank: int) -> str:
        if rank in self._errors:
            return f"tensor-parallel rank {rank} failed: {self._errors[rank]}"
        proc = self.procs[rank - 1]
        code = proc.exitcode
        if code is None:
            return f"tensor-parallel rank {rank} (pid {proc.pid}) stopped answering"
        if code < 0:
            text = f"tensor-parallel rank {rank} (pid {proc.pid}) was killed by {_signal_name(-code)}"
        else:
            text = f"tensor-parallel rank {rank} (pid {proc.pid}) exited with status {code}"
        tail = proc.stderr_tail()
        return f"{text}; the end of its stderr:\n{tail}" if tail else text

    # ------------------------------------------------------------------ teardown

    def close(self, graceful: bool = True) -> None:
        """Stop every worker and leave the group; idempotent. `graceful`: tell the workers to stop
        (a broadcast) before closing their lifelines; after a fault they are stopped by the lifelines
        alone. Returns once every worker has exited (killed after a few seconds if it lingers)."""
        if self._closed:
            return
        self._closed = True
        healthy = graceful and self.channel is not None and all(p.is_alive() for p in self.procs)
        if healthy and self.channel is not None:
            with contextlib.suppress(Exception):
                self.channel.send_stop()
        destroy_group(abort=not healthy)
        self._finalizer()
        for conn in self.reports:
            with contextlib.suppress(OSError):
                conn.close()
        logger.info(
            "tensor parallel: stopped %d workers (exit codes %s)", len(self.procs), [p.exitcode for p in self.procs]
        )


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def all_reduce_min(values: list[int]) -> list[int]:
    """Element-wise minimum of `values` over the group (every rank calls it with as many values)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return [int(v) for v in t.tolist()]
