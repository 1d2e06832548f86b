"""The engine: one loop that admits, schedules, runs and streams every request (continuous batching)."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from helexa.admission import AdmissionConfig, AdmissionController, AdmissionObserver, AdmissionRejected, Ticket
from helexa.engine.config import EngineConfig
from helexa.engine.faults import FaultInjector
from helexa.engine.runner import ModelRunner, StepInputs
from helexa.engine.scheduler import schedule
from helexa.engine.sequence import Sequence
from helexa.engine.stats import RateTracker
from helexa.engine.stream import RequestStream, TokenEvent, TokenLogprob
from helexa.kvcache import BatchBuilder, BlockPool, estimate_activation_bytes, kv_budget
from helexa.model.config import ModelConfig
from helexa.model.text.detokenizer import IncrementalDetokenizer
from helexa.model.loader import load_model, resolve_dtype
from helexa.model.weights.pull import DEFAULT_MODEL, resolve_model
from helexa.model.sampling import SampleResult, SamplingParams, make_generator
from helexa.model.text.stopping import StopChecker, finish_reason
from helexa.model.text.tokenizer import Tokenizer

logger = logging.getLogger("helexa.engine")


class EngineClosed(RuntimeError):
    """The engine is shutting down and takes no new requests."""


class EngineError(RuntimeError):
    """A request failed because of the engine, not its input; the message carries the cause."""


class RequestFailed(EngineError):
    """One request failed because of its own parameters (its sampling raised); the others go on."""


class DeviceFault(EngineError):
    """The model could not be recovered after repeated device faults (500 `device_fault`).

    The message carries the last fault's underlying error text.
    """


@dataclass(frozen=True)
class RequestHandle:
    """A submitted request: read its `stream` until the final event; `abort` it by `request_id`."""

    request_id: str
    stream: RequestStream
    prompt_tokens: int
    max_tokens: int
    ticket: Ticket


@dataclass
class EngineCounters:
    """Totals since start, read by the server's metrics (monotonic, updated on the engine thread)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    step_seconds: float = 0.0
    model_seconds: float = 0.0
    device_faults: int = 0
    model_reloads: int = 0


class Engine:
    """Loads a model into a KV pool it owns and serves requests through one continuous batch.

    Guarantees: every submitted request's stream ends with exactly one final event; every block a
    request held returns to the pool when it ends (finish, abort, error); a running sequence never
    runs out of blocks (admission reserved them); greedy output does not depend on what else runs
    in the batch. `step()` may be driven directly (offline use) or by `start()`'s thread — not both.
    """

    def __init__(self, config: EngineConfig | None = None, *, observer: AdmissionObserver | None = None) -> None:
        self.config = config = config or EngineConfig()
        load_start = time.perf_counter()
        self.device = _resolve_device(config.device)
        model_dir = resolve_model(config.model if config.model is not None else DEFAULT_MODEL)
        self.model_dir: Path = model_dir
        self.model_name = config.model if config.model is not None else DEFAULT_MODEL
        self.model_config = ModelConfig.from_pretrained(model_dir)
        self.dtype = resolve_dtype(config.dtype, self.device, self.model_config.dtype)
        self.max_model_len = self._max_model_len(config, self.model_config)
        self.tokenizer = Tokenizer.from_pretrained(model_dir)
        self._load()
        self.first_num_blocks = self.budget.num_blocks
        self.rates = RateTracker()
        self.counters = EngineCounters()
        self.admission = AdmissionController(
            AdmissionConfig(block_size=config.block_size, num_blocks=self.budget.num_blocks,
                            max_model_len=self.max_model_len, max_num_seqs=config.max_num_seqs,
                            max_queue_depth=config.max_queue_depth, max_wait_secs=config.max_wait_secs,
                            default_max_tokens=config.default_max_tokens, policy=config.admission_policy),
            rates=self.rates.rates(), observer=observer, wakeup=self._wake,
            blocks_free=lambda: self.pool.num_free_blocks if self.pool is not None else 0,
        )
        self._faults = FaultInjector.from_env()
        self._step_no = 0  # steps that ran the model, counted from 1 (HELEXA_FAULT_INJECT counts these)
        self._consecutive_faults = 0
        self.fault_cause: str | None = None  # set when the node gives up: why it is poisoned
        self.last_reload_seconds: float | None = None
        self._running: list[Sequence] = []
        self._pending: dict[str, RequestHandle] = {}  # submitted, not ended; any thread, under _lock
        self._aborts: set[str] = set()  # abort requests for running sequences, under _lock
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._wakeup = threading.Condition()  # its own lock: admission calls _wake while _lock may be held
        self._woken = False
        self._closed = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.load_seconds = time.perf_counter() - load_start
        logger.info("engine: loaded %s on %s %s in %.2fs; max_model_len=%d max_num_seqs=%d "
                    "max_num_batched_tokens=%d attention=%s", self.model_name, self.device, _dtype_name(self.dtype),
                    self.load_seconds, self.max_model_len, config.max_num_seqs, config.max_num_batched_tokens,
                    config.attention_backend)

    def _load(self) -> None:
        """Load the weights and allocate the KV pool from the config (at start and on every reload).

        The budget is a function of the config and the model's shapes only, so every load gives
        the same block count.
        """
        config, mc = self.config, self.model_config
        model = load_model(self.model_dir, dtype=self.dtype, device=self.device,
                           attention_backend=config.attention_backend)
        self.budget = kv_budget(
            block_size=config.block_size, num_layers=mc.num_hidden_layers, num_kv_heads=mc.num_key_value_heads,
            head_dim=mc.head_dim, dtype=self.dtype, device=self.device,
            weight_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
            activation_reserve_bytes=estimate_activation_bytes(
                hidden_size=mc.hidden_size, intermediate_size=mc.intermediate_size,
                num_heads=mc.num_attention_heads, num_kv_heads=mc.num_key_value_heads, head_dim=mc.head_dim,
                vocab_size=mc.vocab_size, max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs, dtype=self.dtype),
            num_blocks=config.num_blocks, kv_cache_memory=config.kv_cache_memory,
            gpu_memory_utilization=config.gpu_memory_utilization,
        )
        logger.info("%s", self.budget.describe())
        self.pool: BlockPool | None = BlockPool(self.budget.num_blocks, config.block_size, mc.num_hidden_layers,
                                                mc.num_key_value_heads, mc.head_dim, self.dtype, self.device)
        self._builder = BatchBuilder(self.pool, config.max_num_seqs, self.max_model_len)
        self.runner = ModelRunner(model, self.pool, self._builder, self.device,
                                  sample_vocab_size=min(self.tokenizer.vocab_size, mc.vocab_size))

    def _unload(self) -> None:
        """Drop the model and the pool and give their device memory back."""
        self.runner = None  # type: ignore[assignment]
        self._builder = None  # type: ignore[assignment]
        self.pool = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def model_state(self) -> str:
        """`loaded`, `reloading` or `poisoned`."""
        return self.admission.model_state

    # ------------------------------------------------------------------ requests (any thread)

    def default_max_tokens(self, prompt_tokens: int) -> int:
        """Output tokens reserved for a request that gives no `max_tokens` (at least 1)."""
        return max(1, min(self.max_model_len - prompt_tokens, self.config.default_max_tokens))

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> RequestHandle:
        """Queue a tokenised request for generation; thread-safe.

        Raises `AdmissionRejected` (never fits, queue full, wait beyond the deadline),
        `ValueError` (empty prompt, token ids outside the vocabulary, bad params) or `EngineClosed`.
        """
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("the prompt is empty: at least one token is needed")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        with self._lock:
            if self.fault_cause is not None:
                raise DeviceFault(self.fault_cause)
            if self._closed:
                raise EngineClosed("the engine is shutting down and admits no new requests")
            request_id = request_id or f"req-{next(self._ids)}"
            if request_id in self._pending:
                raise ValueError(f"request id {request_id!r} is already in use")
            stream = RequestStream(request_id)
            seq_args = (request_id, prompt, params, stream)
            ticket = self.admission.submit(len(prompt), params.max_tokens, payload=seq_args)
            handle = RequestHandle(request_id, stream, len(prompt), ticket.max_tokens, ticket)
            self._pending[request_id] = handle
        return handle

    def abort(self, request_id: str) -> None:
        """Stop a request (queued or running) at the next step boundary; idempotent, thread-safe."""
        with self._lock:
            handle = self._pending.get(request_id)
            if handle is None:
                return
            self._aborts.add(request_id)
        self.admission.cancel(handle.ticket)
        if handle.ticket.state.ended and not handle.ticket.seen_by_engine:
            self._end_unstarted(handle, TokenEvent(finish_reason="abort"))
        self._wake()

    def snapshot(self) -> dict[str, Any]:
        """The `/v1/admission` body: pool and admission numbers and the model state."""
        return self.admission.snapshot()

    # ------------------------------------------------------------------ the loop

    def step(self) -> bool:
        """One engine step: admit, schedule, run, sample, stream. Returns False when there was nothing to run.

        A failure while running the batch is a device fault: it is logged with its cause, the model
        and pool are rebuilt with the same config, and the running sequences are replayed.
        """
        if self.fault_cause is not None:
            return False
        self._take_admitted()
        self._apply_aborts()
        chunks = schedule(self._running, self.config.max_num_batched_tokens)
        if not chunks:
            return False
        self._step_no += 1
        t0 = time.perf_counter()
        try:
            inputs = self.runner.prepare(chunks)
            for chunk in chunks:
                chunk.seq.num_computed += chunk.num_new
            t1 = time.perf_counter()
            self._faults.check(self._step_no)
            samples, failures = self.runner.execute(inputs, [s.generator for s in inputs.sampled])
        except Exception as exc:  # any failure on the device side: recover and replay
            self._on_device_fault(exc, chunks)
            return True
        t2 = time.perf_counter()
        self._consecutive_faults = 0
        self._postprocess(inputs, samples, failures)
        t3 = time.perf_counter()
        self._record(inputs, t3 - t0, (t1 - t0) + (t3 - t2), t2 - t1)
        return True

    def has_work(self) -> bool:
        """True while any request is running or waiting for admission."""
        return bool(self._running) or self.admission.queue_depth > 0 or bool(self._pending)

    def start(self) -> None:
        """Run the loop on a daemon thread until `shutdown`."""
        if self._thread is not None:
            raise RuntimeError("the engine loop is already running")
        self._thread = threading.Thread(target=self._loop, name="helexa-engine", daemon=True)
        self._thread.start()

    def shutdown(self, grace_seconds: float = 0.0) -> None:
        """Stop admitting, let running requests finish for up to `grace_seconds`, abort the rest, stop the loop."""
        with self._lock:
            self._closed = True
        deadline = time.monotonic() + max(0.0, grace_seconds)
        while self.has_work() and time.monotonic() < deadline:
            if self._thread is None:
                self.step()
            else:
                time.sleep(0.01)
        with self._lock:
            ids = list(self._pending)
        for request_id in ids:
            self.abort(request_id)
        if self._thread is not None:
            bound = time.monotonic() + 30
            while self.has_work() and time.monotonic() < bound and self._thread.is_alive():
                time.sleep(0.01)
            with self._wakeup:
                self._stopping = True
                self._wakeup.notify_all()
            self._thread.join(timeout=30)
            self._thread = None
        else:
            self.step()

    def check_integrity(self) -> None:
        """Engine-level invariants: pool and admission consistent; tables cover exactly the computed tokens."""
        self.pool.check_integrity()
        self.admission.check_integrity()
        self._builder.check_integrity()
        for seq in self._running:
            if seq.table is None or seq.table.num_tokens != seq.num_computed:
                raise AssertionError(f"{seq.request_id}: block table covers {seq.table and seq.table.num_tokens} "
                                     f"tokens, {seq.num_computed} computed")
            if seq.table.num_blocks > seq.ticket.blocks_reserved:
                raise AssertionError(f"{seq.request_id}: {seq.table.num_blocks} blocks over its reservation "
                                     f"of {seq.ticket.blocks_reserved}")

    # ------------------------------------------------------------------ step phases

    def _take_admitted(self) -> None:
        """Turn newly granted tickets into running sequences; end expired and cancelled ones."""
        polled = self.admission.poll()
        for ticket in polled.expired:
            handle = self._pending.get(ticket.payload[0])
            if handle is not None:
                self._end_unstarted(handle, TokenEvent(finish_reason="error", error=ticket.error))
        for ticket in polled.granted:
            request_id, prompt, params, stream = ticket.payload
            params = dataclasses.replace(params, max_tokens=ticket.max_tokens)
            seq = Sequence(
                request_id=request_id, prompt_len=len(prompt), token_ids=list(prompt), params=params,
                ticket=ticket, stream=stream,
                detokenizer=IncrementalDetokenizer(self.tokenizer, prompt),
                stop_checker=StopChecker(params.stop),
                generator=make_generator(params.seed, self.device) if params.seed is not None else None,
                arrival=ticket.arrival,
            )
            seq.table = self._builder.new_table()
            self._running.append(seq)
        for ticket in polled.cancelled:
            with self._lock:
                self._aborts.add(ticket.payload[0])

    def _apply_aborts(self) -> None:
        with self._lock:
            if not self._aborts:
                return
            aborts, self._aborts = self._aborts, set()
        for seq in [s for s in self._running if s.request_id in aborts]:
            self._finish(seq, TokenEvent(finish_reason="abort", num_prompt_tokens=seq.prompt_len,
                                         num_output_tokens=seq.num_output))

    def _postprocess(self, inputs: StepInputs, samples: SampleResult | None,
                     failures: dict[int, Exception] | None = None) -> None:
        """Append each sampled token, detokenise, check stops, stream the event, finish what ended.

        The whole step's progress reaches admission before any sequence is released, so its wait
        estimates never see half a step.
        """
        finished: list[tuple[Sequence, TokenEvent]] = []
        if samples is not None:
            now = time.monotonic()
            for row, seq in enumerate(inputs.sampled):
                if failures and row in failures:  # this request's own parameters broke its sampling
                    error = RequestFailed(f"sampling failed for this request: {type(failures[row]).__name__}: "
                                        f"{failures[row]}")
                    logger.warning("engine: request %s failed in sampling: %s", seq.request_id, error)
                    finished.append((seq, TokenEvent(finish_reason="error", error=error,
                                                     num_prompt_tokens=seq.prompt_len,
                                                     num_output_tokens=seq.num_output)))
                    continue
                event = self._append_token(seq, samples, row, now)
                if event.finished:
                    finished.append((seq, event))
                else:
                    seq.stream.put(event)
        ending = {id(seq) for seq, _ in finished}
        for seq in self._running:
            if id(seq) not in ending:
                self.admission.progress(seq.ticket, prompt_prefilled=min(seq.num_computed, seq.prompt_len),
                                        tokens_generated=seq.num_output, blocks_allocated=seq.table.num_blocks)
        for seq, event in finished:
            self._finish(seq, event)

    def _append_token(self, seq: Sequence, samples: SampleResult, row: int, now: float) -> TokenEvent:
        """Record one sampled token on `seq` and build its event (final when the sequence ends)."""
        token = samples.token_ids[row]
        seq.token_ids.append(token)
        if seq.first_token_at is None:
            seq.first_token_at = now
        self.counters.generation_tokens += 1
        reason = finish_reason(token, seq.num_output, seq.params, self.tokenizer.eos_token_ids)
        text = ""
        if reason != "stop":  # a stop token or EOS is never shown
            result = seq.stop_checker.feed(seq.detokenizer.push(token))
            text = result.emit
            if result.stopped:
                reason = "stop"
            elif reason is not None:  # length: release everything held back
                text += seq.stop_checker.feed(seq.detokenizer.flush()).emit
                if not seq.stop_checker.stopped:
                    text += seq.stop_checker.flush()
        logprobs: tuple[TokenLogprob, ...] = ()
        if seq.params.logprobs is not None:
            top = samples.top_logprobs[row] or ()
            logprobs = (TokenLogprob(token, float(samples.logprobs[row]), tuple(top)),)
        return TokenEvent(token_ids=(token,), text=text, logprobs=logprobs, finish_reason=reason,
                          num_prompt_tokens=seq.prompt_len, num_output_tokens=seq.num_output)

    def _finish(self, seq: Sequence, final: TokenEvent) -> None:
        """End a running sequence: its blocks and reservation return, its stream gets the final event."""
        seq.finished_at = time.monotonic()
        self._running.remove(seq)
        if seq.table is not None and not seq.table.released and self._builder is seq.table._builder:
            self._builder.release(seq.table)  # (tables of a pool dropped by a reload need no release)
        self.admission.release(seq.ticket)
        with self._lock:
            self._pending.pop(seq.request_id, None)
            self._aborts.discard(seq.request_id)
        seq.stream.put(final)

    def _end_unstarted(self, handle: RequestHandle, final: TokenEvent) -> None:
        with self._lock:
            self._pending.pop(handle.request_id, None)
            self._aborts.discard(handle.request_id)
        handle.stream.put(final)

    def _record(self, inputs: StepInputs, step_seconds: float, overhead_seconds: float, model_seconds: float) -> None:
        self.counters.steps += 1
        self.counters.step_seconds += step_seconds
        self.counters.model_seconds += model_seconds
        self.counters.prompt_tokens += inputs.num_prefill_tokens
        self.rates.observe_step(step_seconds, inputs.num_decode_tokens, inputs.num_prefill_tokens, overhead_seconds)
        self.admission.set_rates(self.rates.rates())

    # ------------------------------------------------------------------ device faults

    def _on_device_fault(self, exc: BaseException, chunks: list) -> None:
        """Log the fault with its cause and the batch shape, then reload and replay, or give up."""
        self.counters.device_faults += 1
        self._consecutive_faults += 1
        cause = f"{type(exc).__name__}: {exc}"
        logger.error("engine: device fault at step %d (batch: %d sequences, %d tokens; consecutive=%d/%d): %s",
                     self._step_no, len(chunks), sum(c.num_new for c in chunks), self._consecutive_faults,
                     self.config.max_fault_retries, cause, exc_info=exc)
        self.admission.set_model_state("poisoned")
        if self._consecutive_faults > self.config.max_fault_retries:
            self._give_up(f"device fault not recovered after {self.config.max_fault_retries} reloads: {cause}")
            return
        self._reload(cause)

    def _reload(self, cause: str) -> None:
        """Rebuild the model and pool with the same config and replay every running sequence.

        Reservations in admission survive unchanged; only the physical blocks are rebuilt. A block
        count different from the first load's keeps the node poisoned rather than serve with another budget.
        """
        self.admission.set_model_state("reloading")
        start = time.perf_counter()
        backoff = self.config.fault_backoff_secs * 2 ** (self._consecutive_faults - 1)
        while True:
            time.sleep(min(backoff, 30.0))
            try:
                self._unload()
                self._load()
                break
            except Exception as exc:  # a failed reload is one more consecutive fault
                self.counters.device_faults += 1
                self._consecutive_faults += 1
                cause = f"{type(exc).__name__}: {exc}"
                logger.error("engine: reload failed (consecutive=%d/%d): %s", self._consecutive_faults,
                             self.config.max_fault_retries, cause, exc_info=exc)
                if self._consecutive_faults > self.config.max_fault_retries:
                    self._give_up(f"model reload failed {self._consecutive_faults} times in a row: {cause}")
                    return
                backoff *= 2
        if self.budget.num_blocks != self.first_num_blocks:
            logger.error("engine: reload gave %d KV blocks, first load gave %d; staying poisoned",
                         self.budget.num_blocks, self.first_num_blocks)
            self._give_up(f"KV budget changed across reload ({self.first_num_blocks} -> {self.budget.num_blocks} "
                          f"blocks) after device fault: {cause}")
            return
        for seq in self._running:  # replay: re-prefill prompt + tokens generated so far
            seq.num_computed = 0
            seq.table = self._builder.new_table()
            self.admission.progress(seq.ticket, prompt_prefilled=0, blocks_allocated=0)
        self.counters.model_reloads += 1
        self.last_reload_seconds = time.perf_counter() - start
        self.admission.set_model_state("loaded")
        logger.warning("engine: reloaded after device fault in %.2fs (%d KV blocks, as at first load); "
                       "replaying %d sequences", self.last_reload_seconds, self.budget.num_blocks,
                       len(self._running))

    def _give_up(self, cause: str) -> None:
        """Stay poisoned: fail running and queued requests with `DeviceFault`; refuse new ones."""
        logger.error("engine: model poisoned for good: %s", cause)
        error = DeviceFault(cause)
        with self._lock:
            self.fault_cause = cause
        self.admission.set_model_state("poisoned")
        for seq in list(self._running):
            self._finish(seq, TokenEvent(finish_reason="error", error=error, num_prompt_tokens=seq.prompt_len,
                                         num_output_tokens=seq.num_output))
        with self._lock:
            waiting = list(self._pending.values())  # queued, or granted and not yet running
        for handle in waiting:
            self.admission.cancel(handle.ticket)
            self._end_unstarted(handle, TokenEvent(finish_reason="error", error=error))

    # ------------------------------------------------------------------ thread plumbing

    def _wake(self) -> None:
        with self._wakeup:
            self._woken = True
            self._wakeup.notify_all()

    def _loop(self) -> None:
        while True:
            with self._wakeup:
                if self._stopping:
                    return
            try:
                worked = self.step()
            except Exception as exc:  # a bug outside the device work must not kill the loop
                logger.exception("engine: step failed outside the model with %d running sequences",
                                 len(self._running))
                self._fail_running(exc)
                worked = True
            if worked:
                continue
            deadline = self.admission.next_deadline()
            timeout = 0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))
            with self._wakeup:
                if not self._woken and not self._stopping:
                    self._wakeup.wait(timeout)
                self._woken = False

    def _fail_running(self, exc: BaseException) -> None:
        error = EngineError(f"engine error: {type(exc).__name__}: {exc}")
        for seq in list(self._running):
            self._finish(seq, TokenEvent(finish_reason="error", error=error, num_prompt_tokens=seq.prompt_len,
                                         num_output_tokens=seq.num_output))

    @staticmethod
    def _max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
        limit = model_config.max_model_len
        if config.max_model_len is None:
            return limit
        if config.max_model_len > limit:
            raise ValueError(f"--max-model-len {config.max_model_len} exceeds the model's "
                             f"max_position_embeddings {limit}")
        return config.max_model_len


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA device is available")
    return torch.device(name)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
