"""The server's side of the engine core: `EngineClient` runs an `Engine` in a child process and reads like one.

The server keeps HTTP, validation, templates, tokenising and streaming; the core process
(`helexa.engine.core.process`) keeps admission, scheduling, the KV owner, the model runner and its
tensor-parallel workers. They talk over one socket pair (`wire`: plain trees, `marshal` frames).
`EngineClient` offers what the server reads of an `Engine` (`submit`, `abort`, `snapshot`, `view`,
`counters`, `health`, `flush_prefix_cache`, `shutdown`, the tokenizer and the model's facts); a call
that the core answers is one round trip, and `submit` returns only once admission has decided
(granted, queued with its ticket, or `AdmissionRejected`), exactly as in-process.

The core's death (SIGKILL, segfault, OOM kill) is a device fault: `FaultRecovery` logs and counts it,
backs off and starts a new core, which must agree the block count of the first; every request in
flight is then submitted again in its original order (queued ones keep their place) and replayed:
the events a stream already delivered are computed again and checked, not sent twice. That is exact
because a token is a function of the tokens before it (greedy, or seeded: a request that samples with
no seed is given one at submit for this). Repeated deaths end with the model poisoned, as faults do.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from helexa.admission import AdmissionRejected, Ticket
from helexa.config import EngineConfig
from helexa.engine.core.wire import (
    ChannelClosed,
    decode_error,
    event_from_plain,
    from_plain,
    read_frame,
    register_error,
    to_plain,
    write_frame,
)
from helexa.engine.faults import ModelHealth
from helexa.engine.interface import DeviceFault, EngineClosed, EngineCounters, EngineError, RequestFailed, RequestHandle
from helexa.engine.recovery import FaultRecovery
from helexa.engine.sequence import Request
from helexa.engine.stream import RequestStream, TokenEvent, Wakeups
from helexa.engine.view import EngineView
from helexa.kvcache import KVBudget
from helexa.model.config import ModelConfig
from helexa.model.generation_defaults import SamplingDefaults, resolve_sampling_defaults
from helexa.model.sampling import SamplingParams
from helexa.model.sampling.grammar import GrammarTokenizer
from helexa.model.text.tokenizer import Tokenizer
from helexa.model.weights.pull import DEFAULT_MODEL, DownloadError, resolve_model

logger = logging.getLogger("helexa.engine.core")

__all__ = ["DEFAULT_ENGINE_PROCESS", "CoreDied", "CoreHealth", "EngineClient", "core_nice", "engine_process_enabled"]

_CALL_TIMEOUT_SECS = 60.0
_START_TIMEOUT_SECS = 600.0

for _cls in (DeviceFault, DownloadError, EngineClosed, EngineError, RequestFailed):
    register_error(_cls)
register_error(
    AdmissionRejected, lambda d: AdmissionRejected(d["reason"], d["message"], d["retry_after"], d["arithmetic"])
)


DEFAULT_ENGINE_PROCESS = True  # `python -m helexa.server` runs its engine core in a child process unless told not to


def engine_process_enabled(value: str | None = None, default: bool = DEFAULT_ENGINE_PROCESS) -> bool:
    """Whether `HELEXA_ENGINE_PROCESS` (or `value`) asks for the engine core in its own process:
    `1`/`true`/`yes`/`on` yes, `0`/`false`/`no`/`off` no, unset or empty `default` (the server's default: yes);
    anything else raises `ValueError`."""
    text = (os.environ.get("HELEXA_ENGINE_PROCESS", "") if value is None else value).strip().lower()
    if text == "":
        return default
    if text in ("0", "false", "no", "off"):
        return False
    if text in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"HELEXA_ENGINE_PROCESS must be 0 or 1 (or true/false), got {text!r}")


DEFAULT_CORE_NICE = 0


def core_nice(value: str | None = None) -> int:
    """How much nicer than the server the engine core runs (`HELEXA_CORE_NICE`, or `value`; default
    `DEFAULT_CORE_NICE`): an int from 0 to 19 added to the core's scheduling niceness at its start, so the
    server's event loop wins a shared CPU whenever it has work (a `/health` probe, a new request, a token to
    stream) and the core computes in the rest. Anything else raises `ValueError`."""
    text = (os.environ.get("HELEXA_CORE_NICE", "") if value is None else value).strip()
    if not text:
        return DEFAULT_CORE_NICE
    if not text.isdigit() or int(text) > 19:
        raise ValueError(f"HELEXA_CORE_NICE must be an integer from 0 to 19, got {text!r}")
    return int(text)


class _ChannelLost(EngineError):
    """A call the core never answered: it died meanwhile."""


class CoreDied(RuntimeError):
    """The engine core process ended without being asked to (its exit status or signal is the message)."""


@dataclass(eq=False)
class _Remote:
    """A request in flight in the core, as the server remembers it to submit again after a crash."""

    handle: RequestHandle
    salt: str | None
    key: str | None
    delivered: list[tuple[int, ...]] = field(default_factory=list)  # token ids of each event the stream got
    replayed: int | None = None  # while replaying: how many of `delivered` the new core has re-derived
    queue: tuple[int, float, float] | None = None  # while it waits: (place, seconds to start, when reported)
    aborted: bool = False  # the abort may have gone to a core that was dying: the replay must not restart it


class CoreProcess:
    """One started core: the child process, its channel, and what it said when ready (`info`, `budget`)."""

    def __init__(self, config: EngineConfig) -> None:
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "helexa.engine.core", str(theirs.fileno()), str(os.getpid())],
            pass_fds=(theirs.fileno(),),
            env=env,
        )
        theirs.close()
        self.sock = ours
        self.alive = True  # until its channel ends (under the client's lock)
        self.calls: dict[int, Future[Any]] = {}  # sent to this core, not yet answered (under the client's lock)
        logger.info("engine core: started (pid %d); loading", self.process.pid)
        try:
            write_frame(ours, to_plain(config))
            kind, body = read_frame(ours)
        except ChannelClosed:
            self.close(graceful=False)
            raise CoreDied(f"the engine core exited while loading ({self.exit_cause()})") from None
        if kind == "load_error":
            self.close(graceful=False)
            raise decode_error(body)
        self.info: dict[str, Any] = body
        self.budget: KVBudget = from_plain(KVBudget, body["budget"])

    @property
    def pid(self) -> int:
        return self.process.pid

    def exit_cause(self) -> str:
        """How the process ended (`exit status N`, `killed by SIGKILL`), waiting for it up to 5 s."""
        try:
            code = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "still running"
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit status {code}"

    def close(self, graceful: bool = True) -> None:
        """Stop the process (SIGKILL unless `graceful`, where it has 30 s to exit by itself) and reap it."""
        try:
            self.sock.close()
        except OSError:
            pass
        if self.process.poll() is None:
            if graceful:
                try:
                    self.process.wait(timeout=30)
                    return
                except subprocess.TimeoutExpired:
                    pass
            self.process.kill()
        self.process.wait()


class EngineClient:
    """An `Engine` in its own process, as the server reads an `Engine` (see the module doc).

    Guarantees: `submit` raises what `Engine.submit` raises, with the same fields; every submitted
    request's stream ends with exactly one final event, across core deaths; while a core is being
    restarted `health.state` is `reloading` and `submit` refuses as a reloading engine would; no core
    process outlives `shutdown` or this process.
    """

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.core_nice = core_nice()  # checked here: a bad value stops the server before any core starts
        self.model_name = config.model if config.model is not None else DEFAULT_MODEL
        self.model_dir = resolve_model(self.model_name)
        self.model_config = ModelConfig.from_pretrained(self.model_dir)
        self.tokenizer = Tokenizer.from_pretrained(self.model_dir)
        self.sampling_defaults: SamplingDefaults = resolve_sampling_defaults(config.generation_config, self.model_dir)
        self.grammar_tokenizer = GrammarTokenizer(
            self.tokenizer.backend.to_str, tuple(sorted(self.tokenizer.eos_token_ids))
        )  # the vocabulary's JSON is made on the first grammar
        self._lock = threading.Lock()  # guards _inflight, each core's `alive` and `calls`, and _serving's clearing
        self._inflight: OrderedDict[str, _Remote] = OrderedDict()  # in submit order
        self._call_ids = itertools.count(1)
        self._request_ids = itertools.count(1)
        self._write_lock = threading.Lock()
        self._closing = False
        self._core_health = CoreHealth("loaded", None, None, None)
        self._died = threading.Event()
        self._serving = threading.Event()  # set while a core runs and has been given every request in flight
        self.restarts = 0
        self.own_health = ModelHealth()  # the core process's: loaded, reloading while it restarts, poisoned
        self._core: CoreProcess | None = None
        self._counter_base = EngineCounters()  # the dead cores' counters, as last read
        self._last_counters = EngineCounters()  # the running core's, as last read
        self._last_snapshot: dict[str, Any] = {}
        self._start_error: BaseException | None = None
        started = threading.Event()
        self._supervisor = threading.Thread(target=self._supervise, args=(started,), name="helexa-core", daemon=True)
        self._supervisor.start()  # the thread that starts every core: a core dies with it (PR_SET_PDEATHSIG)
        started.wait()
        if self._start_error is not None:
            raise self._start_error
        assert self._core is not None
        info = self._core.info
        self._budget: KVBudget = self._core.budget
        self.first_num_blocks: int = self._budget.num_blocks
        self.max_model_len: int = info["max_model_len"]
        self.device: str = info["device"]  # the core's device and model dtype, as named (no torch in this process)
        self.dtype: str = info["dtype"]
        self.load_seconds: float = info["load_seconds"]
        self.recovery: FaultRecovery = FaultRecovery(
            lambda: CoreProcess(self.config),
            self.own_health,
            first_num_blocks=self.first_num_blocks,
            max_retries=config.max_fault_retries,
            backoff_secs=config.fault_backoff_secs,
            device_type="cpu",  # the server holds no device memory to give back
        )

    # ------------------------------------------------------------------ what the server reads

    @property
    def budget(self) -> KVBudget:
        """The KV budget of the first core's pool (every restart must agree it)."""
        return self._budget

    @property
    def core_pid(self) -> int | None:
        """The running core process's id (None while none runs)."""
        core = self._core
        return None if core is None else core.pid

    @property
    def health(self) -> ModelHealth | CoreHealth:
        """The core process's health while it restarts or gave up, else the one the core last reported."""
        if self.own_health.state != "loaded":
            return self.own_health
        return self._core_health

    @property
    def counters(self) -> EngineCounters:
        """The counters of every core since start (a dead core's as last read: monotonic, though what it counted
        after that reading is lost), with the core deaths among the device faults and restarts among the
        reloads. While a core restarts: the last reading."""
        if self._serving.is_set():
            try:
                self._last_counters = from_plain(EngineCounters, self._call("counters")["counters"])
            except EngineError:  # it died meanwhile: the last reading stands
                pass
        total = _add_counters(self._counter_base, self._last_counters)
        total.device_faults += self.recovery.faults
        total.model_reloads += self.recovery.reloads
        return total

    @property
    def kv_events(self) -> _KVEventCounts | None:
        """The KV event publisher's batch counts in the core (None without `--kv-events-endpoint`)."""
        counts = self._call("counters")["kv_events"]
        return None if counts is None else _KVEventCounts(*counts)

    @property
    def admission(self) -> _RemoteAdmission:
        return _RemoteAdmission(self)

    @property
    def request_sizes(self) -> _RemoteSizes:
        return _RemoteSizes(self)

    def snapshot(self) -> dict[str, Any]:
        """`Engine.snapshot()` of the core; while a core restarts, the last one read with the `model_state` now."""
        if self._serving.is_set():
            try:
                self._last_snapshot = self._call("snapshot")
                return self._last_snapshot
            except EngineError:  # it died meanwhile
                pass
        if not self._last_snapshot:
            self._last_snapshot = self._call("snapshot")  # none read yet: only a live core can answer
        return {**self._last_snapshot, "model_state": self.health.state}

    def view(self) -> EngineView:
        """`Engine.view()` of the core."""
        return from_plain(EngineView, self._call("view"))

    def check_integrity(self) -> None:
        """`Engine.check_integrity()` in the core (an `AssertionError` there is raised here)."""
        self._call("check_integrity")

    def flush_prefix_cache(self, timeout: float = 10.0) -> int:
        return self._call("flush_prefix_cache", timeout, timeout=timeout + 5)

    # ------------------------------------------------------------------ requests

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        cache_salt: str | None = None,
        prompt_cache_key: str | None = None,
    ) -> RequestHandle:
        """`Engine.submit` in the core: returns once admission has decided; raises what it raises."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if self._closing:
            raise EngineClosed("the engine is shutting down and admits no new requests")
        if self.own_health.fault_cause is not None:
            raise DeviceFault(self.own_health.fault_cause)
        if params.seed is None and params.temperature > 0:  # its replay after a core death must be exact
            params = dataclasses.replace(params, seed=secrets.randbits(62))
        request_id = request_id or f"req-{next(self._request_ids)}"
        prompt = [int(t) for t in prompt_ids]
        stream = RequestStream(request_id)
        ticket = Ticket(0, len(prompt), 0, 0, request_id, 0.0, 0.0, 0.0)
        request = Request(request_id, prompt, params, stream, cache_salt, prompt_cache_key)
        handle = RequestHandle(request_id, stream, len(prompt), 0, ticket, request)
        remote = _Remote(handle, cache_salt, prompt_cache_key)
        while True:  # in flight only while a core serves, and sent to that core: a replay never sends it twice
            with self._lock:
                if request_id in self._inflight:
                    raise ValueError(f"request id {request_id!r} is already in use")
                core = self._core
                if self._serving.is_set() and core is not None:
                    self._inflight[request_id] = remote  # before the call: its first events may beat the reply
                    break
            self._wait_for_core()
        try:
            reply = self._submit_remote(remote, core)
        except _ChannelLost:  # the core died under the call: it is in flight, and the replay submits it
            return dataclasses.replace(handle, max_tokens=params.max_tokens or 0)
        except BaseException:
            with self._lock:
                self._inflight.pop(request_id, None)
            raise
        return dataclasses.replace(handle, prompt_tokens=reply["prompt_tokens"], max_tokens=reply["max_tokens"])

    def _wait_for_core(self) -> None:
        """Return once a core serves; while one restarts, wait as a queued request would (up to the queue's
        `max_wait_secs`), then refuse with `model_reloading` and the estimated seconds left."""
        deadline = time.monotonic() + self.config.admission.max_wait_secs
        while not self._serving.wait(0.1):
            if self._closing:
                raise EngineClosed("the engine is shutting down and admits no new requests")
            if self.own_health.fault_cause is not None:
                raise DeviceFault(self.own_health.fault_cause)
            if time.monotonic() >= deadline:
                break
        else:
            return
        left = self.own_health.reload_seconds_left() or 1.0
        raise AdmissionRejected(
            "model_reloading",
            f"the engine core is restarting after a crash; estimated {left:.0f} s until it serves again",
            max(1, int(-(-left // 1))),
            {"reload_left_s": round(left, 3)},
        )

    def _submit_remote(self, remote: _Remote, core: CoreProcess | None) -> dict[str, Any]:
        h = remote.handle
        args = (h.request.prompt, to_plain(h.request.params), h.request_id, remote.salt, remote.key)
        reply = self._call_on(core, "submit", *args)
        status = reply["queue_status"]
        remote.queue = None if status is None else (status[0], status[1], time.monotonic())
        granted = from_plain(Ticket, reply["ticket"])
        for f in dataclasses.fields(Ticket):  # the handle keeps its ticket object; its fields are the core's
            setattr(h.ticket, f.name, getattr(granted, f.name))
        return reply

    def abort(self, request_id: str) -> None:
        """Stop a request at the core's next step boundary; idempotent, never blocks on the core."""
        with self._lock:
            remote = self._inflight.get(request_id)
            if remote is None:
                return
            remote.aborted = True
        try:
            self._send(("call", 0, "abort", [request_id]))
        except OSError:  # the core is gone: the replay will not resubmit an aborted request
            with self._lock:
                remote = self._inflight.pop(request_id, None)
            if remote is not None:
                remote.handle.stream.put(TokenEvent(finish_reason="abort"))

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._inflight)

    # ------------------------------------------------------------------ shutdown

    def start(self) -> None:
        """The core's loop runs from its start (here for `Engine`'s interface)."""

    def shutdown(self, grace_seconds: float = 0.0) -> None:
        """As `Engine.shutdown` in the core (running requests get `grace_seconds`, the rest are aborted), then
        the core process exits and is reaped; every stream has its final event when this returns. A second
        call (the server's drain shuts the engine down, then its exit does) finds the core's channel ended and
        only reaps it."""
        self._closing = True
        core = self._core
        if core is not None:
            if core.alive:  # else its channel has ended: nothing to ask, only a process to reap
                try:
                    self._call("shutdown", grace_seconds, timeout=grace_seconds + 60)
                except (EngineError, OSError, TimeoutError) as exc:
                    logger.warning("engine core: shutdown call failed (%s); killing it", exc)
            core.close(graceful=True)
        self._died.set()
        self._supervisor.join(timeout=30)
        self._fail_inflight(EngineClosed("the engine is shutting down"), reason="abort")

    # ------------------------------------------------------------------ the channel

    def _call(self, method: str, *args: Any, timeout: float = _CALL_TIMEOUT_SECS) -> Any:
        return self._call_on(self._core, method, *args, timeout=timeout)

    def _call_on(self, core: CoreProcess | None, method: str, *args: Any, timeout: float = _CALL_TIMEOUT_SECS) -> Any:
        """`method(*args)` in `core`, its answer or its exception; `_ChannelLost` when that core is (or goes) away."""
        done: Future[Any] = Future()
        call_id = next(self._call_ids)
        with self._lock:
            if core is None or not core.alive:
                raise _ChannelLost(f"the engine core is not running ({self.own_health.state})")
            core.calls[call_id] = done
        try:
            with self._write_lock:
                write_frame(core.sock, ("call", call_id, method, list(args)))
        except OSError as exc:
            with self._lock:
                core.calls.pop(call_id, None)
            raise _ChannelLost(f"the engine core is not running ({self.own_health.state}): {exc}") from None
        try:
            return done.result(timeout)
        except TimeoutError:
            with self._lock:
                core.calls.pop(call_id, None)
            raise TimeoutError(f"the engine core did not answer {method} within {timeout:g} s") from None

    def _send(self, frame: Any) -> None:
        core = self._core
        if core is None:
            raise ConnectionError(f"no engine core runs ({self.own_health.state})")
        with self._write_lock:
            write_frame(core.sock, frame)

    def _read(self, core: CoreProcess) -> None:
        """Deliver what one core sends until its channel ends; then, unless shutting down, report its death."""
        try:
            while True:
                frame = read_frame(core.sock)
                kind = frame[0]
                if kind == "events":
                    self.recovery.succeeded()  # the core runs steps: its next death is the first in a row again
                    wakeups = Wakeups()  # the server's loop is woken once for the frame, not once per event
                    try:
                        for request_id, plain, granted_at in frame[1]:
                            self._deliver(request_id, event_from_plain(plain), granted_at, wakeups)
                    finally:
                        wakeups.wake()
                elif kind == "reply":
                    _, call_id, ok, value = frame
                    with self._lock:
                        done = core.calls.pop(call_id, None)
                    if done is not None:
                        done.set_result(value) if ok else done.set_exception(decode_error(value))
                elif kind == "queued":
                    self._set_queued(frame[1])
                elif kind == "health":
                    self._core_health = CoreHealth(*frame[1:])
        except (ChannelClosed, OSError):
            pass
        with self._lock:
            core.alive = False
            calls, core.calls = core.calls, {}
        for done in calls.values():
            done.set_exception(_ChannelLost("the engine core exited before answering"))
        if not self._closing:
            self._died.set()

    def _set_queued(self, waiting: list[tuple[str, int, float]]) -> None:
        now, places = time.monotonic(), {rid: (place, secs) for rid, place, secs in waiting}
        with self._lock:
            for request_id, remote in self._inflight.items():
                status = places.get(request_id)
                remote.queue = None if status is None else (*status, now)

    def queue_status(self, request_id: str) -> tuple[int, float] | None:
        """`(place, estimated seconds to start)` while the request waits for admission, as the core last said
        (within 0.25 s); None once it runs or ends. Never a round trip: the event loop may ask."""
        with self._lock:
            remote = self._inflight.get(request_id)
            status = None if remote is None else remote.queue
        if status is None:
            return None
        place, secs, at = status
        return place, max(0.0, secs - (time.monotonic() - at))

    def _deliver(self, request_id: str, event: TokenEvent, granted_at: float | None, wakeups: Wakeups) -> None:
        with self._lock:
            remote = self._inflight.get(request_id)
            if remote is None:
                return
            if event.finished:
                del self._inflight[request_id]
        handle = remote.handle
        remote.queue = None  # it runs (or ended)
        if granted_at is not None:
            handle.ticket.granted_at = granted_at
        if remote.replayed is not None and remote.replayed < len(remote.delivered):
            expected = remote.delivered[remote.replayed]
            remote.replayed += 1
            if not event.finished and event.token_ids == expected:
                if remote.replayed == len(remote.delivered):
                    remote.replayed = None  # caught up: what follows is new
                return  # already sent before the crash: re-derived, not repeated
            error = EngineError(
                f"the replay after an engine core crash diverged at event {remote.replayed} of {request_id}: "
                f"{len(remote.delivered)} events sent, the new core's was {event.token_ids} "
                f"({event.finish_reason or 'not final'}), not {list(expected)}"
            )
            logger.error("engine core: %s", error)
            with self._lock:
                self._inflight.pop(request_id, None)
            self._send_abort_quietly(request_id)
            handle.stream.put(TokenEvent(finish_reason="error", error=error), wakeups)
            return
        if not event.finished:
            remote.delivered.append(event.token_ids)
        handle.stream.put(event, wakeups)

    def _send_abort_quietly(self, request_id: str) -> None:
        try:
            self._send(("call", 0, "abort", [request_id]))
        except OSError:
            pass

    # ------------------------------------------------------------------ supervision

    def _supervise(self, started: threading.Event) -> None:
        """Start the core, then restart it after each death (as `FaultRecovery` decides) and replay.

        Every core is started on this thread, which lives as long as the client: `PR_SET_PDEATHSIG` fires
        when the thread that started a process ends, not only when the process does.
        """
        try:
            self._core = CoreProcess(self.config)
        except BaseException as exc:
            self._start_error = exc
            started.set()
            return
        self._serving.set()
        started.set()
        restarted = False
        while True:
            core = self._core
            assert core is not None
            threading.Thread(target=self._read, args=(core,), name="helexa-core-reader", daemon=True).start()
            if restarted:
                self._replay(core)
            self._died.wait()
            self._died.clear()
            if self._closing:
                return
            with self._lock:  # no request joins the flight from now until the replay has resubmitted it
                self._serving.clear()
                inflight = len(self._inflight)
            cause = core.exit_cause()
            self._core = None
            core.close(graceful=False)
            outcome = self.recovery.recover(
                CoreDied(f"the engine core process (pid {core.pid}) died: {cause}"),
                f"core process pid {core.pid} with {inflight} requests in flight",
            )
            if outcome.runner is None:
                self._give_up(outcome.cause)
                return
            self._counter_base = _add_counters(self._counter_base, self._last_counters)
            self._last_counters = EngineCounters()
            self._core, restarted = outcome.runner, True
            self.restarts += 1
            self._core_health = CoreHealth("loaded", None, None, None)

    def _replay(self, core: CoreProcess) -> None:
        """Submit every request in flight to the new `core` again, in submit order (queued ones keep their
        place); each replays what its stream has seen. New requests wait until this is done."""
        with self._lock:
            remotes = list(self._inflight.values())
        start = time.perf_counter()
        for remote in remotes:
            if remote.aborted:  # its client is gone: it ends here instead of running again
                with self._lock:
                    self._inflight.pop(remote.handle.request_id, None)
                remote.handle.stream.put(TokenEvent(finish_reason="abort"))
                continue
            remote.replayed = 0 if remote.delivered else None  # one that had sent nothing simply starts
            try:
                self._submit_remote(remote, core)
            except _ChannelLost:  # this core died too: the next one replays what is still in flight
                return
            except Exception as exc:  # refused now (it could not be before): its stream ends with why
                logger.error("engine core: replay of %s refused: %s", remote.handle.request_id, exc)
                with self._lock:
                    self._inflight.pop(remote.handle.request_id, None)
                remote.handle.stream.put(TokenEvent(finish_reason="error", error=exc))
        with self._lock:
            if core.alive:
                self._serving.set()
        logger.warning(
            "engine core: restarted (pid %s, %d KV blocks as at first load); replaying %d requests (%.3fs to submit)",
            core.pid, self.first_num_blocks, len(remotes), time.perf_counter() - start,
        )  # fmt: skip

    def _give_up(self, cause: str) -> None:
        logger.error("engine core: poisoned for good: %s", cause)
        self.own_health.give_up(cause)
        self._fail_inflight(DeviceFault(cause), reason="error")

    def _fail_inflight(self, error: BaseException, reason: str) -> None:
        with self._lock:
            remotes, self._inflight = list(self._inflight.values()), OrderedDict()
        for remote in remotes:
            remote.handle.stream.put(TokenEvent(finish_reason=reason, error=error if reason == "error" else None))


def _add_counters(a: EngineCounters, b: EngineCounters) -> EngineCounters:
    return EngineCounters(**{f.name: getattr(a, f.name) + getattr(b, f.name) for f in dataclasses.fields(a)})


@dataclass(frozen=True)
class CoreHealth:
    """The model's health as the core last reported it (`ModelHealth`'s fields; sent within 50 ms of a change)."""

    state: str
    fault_cause: str | None
    last_reload_seconds: float | None
    left_at_report: float | None  # `reload_seconds_left()` when reported
    reported_at: float = field(default_factory=time.monotonic)

    def reload_seconds_left(self) -> float | None:
        if self.left_at_report is None:
            return None
        return max(0.0, self.left_at_report - (time.monotonic() - self.reported_at))


@dataclass(frozen=True)
class _KVEventCounts:
    published: int
    dropped: int


class _RemoteAdmission:
    """What is read of admission (the server's questions, and the counts an operator or a test reads), answered
    by the core's; each count is one round trip."""

    def __init__(self, client: EngineClient) -> None:
        self._client = client

    def snapshot(self) -> dict[str, Any]:
        """`AdmissionController.snapshot()` in the core."""
        return self._client._call("admission_snapshot")

    @property
    def in_flight(self) -> int:
        return self.snapshot()["in_flight"]

    @property
    def queue_depth(self) -> int:
        return self.snapshot()["queue_depth"]

    @property
    def blocks_reserved(self) -> int:
        return self.snapshot()["blocks_reserved"]

    def queue_status(self, ticket: Ticket) -> tuple[int, float] | None:
        return self._client.queue_status(ticket.request_id or "")

    def estimate_wait(self, prompt_tokens: int, max_tokens: int | None = None, *, worst_case: bool = False) -> float:
        return self._client._call("estimate_wait", prompt_tokens, max_tokens, worst_case)


class _RemoteSizes:
    """`RequestSizes.median_wait`, computed in the core against its own admission."""

    def __init__(self, client: EngineClient) -> None:
        self._client = client

    def median_wait(self, estimate: Any, default: tuple[int, int]) -> float:
        return self._client._call("median_wait", list(default))
