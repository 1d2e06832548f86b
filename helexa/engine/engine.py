"""The engine: one loop that admits, schedules, runs and streams every request (continuous batching).

`Engine.step()` is the spine: take what admission granted, schedule, let the KV owner build the step's
tables, run the model, offer the filled blocks, stream. Who holds which block is the KV owner's
(`helexa.kvcache.KVManager`, `self.kv`); reservations are admission's (`self.admission`); a device fault
goes to `FaultRecovery` (`self.recovery`), which reloads the model, after which the engine replays.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from helexa.admission import AdmissionController, Capacity, Ticket, TicketState
from helexa.admission.estimator import RequestSizes
from helexa.config import EngineConfig
from helexa.engine.faults import FaultInjector, ModelHealth
from helexa.engine.interface import DeviceFault, EngineClosed, EngineCounters, EngineError, RequestFailed, RequestHandle
from helexa.engine.kv_tiers import open_tiers
from helexa.engine.loading import kv_calibration_ids, load
from helexa.engine.output import append_token
from helexa.engine.parallel.group import fault_injection
from helexa.engine.recovery import FaultRecovery
from helexa.engine.runner import ModelRunner, StepInputs, StepSamples
from helexa.engine.scheduler import ScheduledChunk, schedule
from helexa.engine.sequence import Request, Sequence
from helexa.engine.speculative import Drafter, SpecStats
from helexa.engine.step_budget import MeasuredStepCost, StepBudget
from helexa.engine.stream import RequestStream, TokenEvent, Wakeups
from helexa.engine.view import EngineView
from helexa.heap import HeapLevel, release_free_pages, return_large_blocks, trim_heap
from helexa.kvcache import BlockPool, KVBudget, KVManager
from helexa.kvcache.tiers import KVTiers
from helexa.model.config import ModelConfig
from helexa.model.generation_defaults import SamplingDefaults, resolve_sampling_defaults
from helexa.model.loader import resolve_dtype
from helexa.model.sampling import SamplingParams, make_generator
from helexa.model.sampling.grammar import GrammarTokenizer
from helexa.model.text.detokenizer import IncrementalDetokenizer
from helexa.model.text.stopping import StopChecker
from helexa.model.text.tokenizer import Tokenizer
from helexa.model.weights.pull import DEFAULT_MODEL, resolve_model

if TYPE_CHECKING:  # the KV-event stack (msgspec, the publisher) loads with `--kv-events-endpoint` only
    from helexa.cluster import KVEventRecorder

logger = logging.getLogger("helexa.engine")


class Engine:
    """Loads a model into a KV pool it owns and serves requests through one continuous batch.

    Guarantees: every submitted request's stream ends with exactly one final event; every block a
    request held returns to the pool when it ends (finish, abort, error); a running sequence never
    runs out of blocks (admission reserved them, or under `adaptive` grows them, preempting the
    newest request when the pool is short); a preempted request resumes by recomputation with its
    stream uninterrupted; greedy and seeded output does not depend on what else runs in the batch,
    nor on what the prefix cache held (a cached block holds exactly the K/V its tokens would give).
    `step()` may be driven directly (offline use) or by `start()`'s thread — not both.
    """

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        load_start = time.perf_counter()
        return_large_blocks()  # a step's large buffers are unmapped when freed, not kept by the heap
        self.device = _resolve_device(config.device)
        torch.manual_seed(config.seed)  # the default generator unseeded requests draw from
        self.model_name = config.model if config.model is not None else DEFAULT_MODEL
        self.model_dir = resolve_model(self.model_name)
        self.model_config = ModelConfig.from_pretrained(self.model_dir)
        self.dtype = resolve_dtype(config.dtype, self.device, self.model_config.dtype)
        self.max_model_len = _max_model_len(config, self.model_config)
        self.tokenizer = Tokenizer.from_pretrained(self.model_dir)
        self.tokenizer.probe_chat_templates()  # a template that fails on every conversation refuses to start
        self.tokenizer.byte_pieces()  # streaming's byte table, made at load (~0.1 s), not in the first request
        release_free_pages()  # building the tokenizer freed ~14 MiB (default model): not carried into the load
        # Defaults for the sampling fields a request omits (`--generation-config`); read once, before the weights.
        self.sampling_defaults: SamplingDefaults = resolve_sampling_defaults(config.generation_config, self.model_dir)
        logger.info(f"engine: {self.sampling_defaults.describe()}")
        self.grammar_tokenizer = GrammarTokenizer(
            self.tokenizer.backend.to_str, tuple(sorted(self.tokenizer.eos_token_ids))
        )  # the vocabulary's JSON is made on the first grammar
        # Checked before any worker process starts: which rank a test's injected faults happen on.
        fault_rank = fault_injection(config.tensor_parallel_size)[0]
        self.runner: ModelRunner | None = self._load_runner()
        self.first_num_blocks = self.runner.budget.num_blocks
        self.health = ModelHealth()
        # The one cost model of a step: it sizes prefill chunks and gives admission its rates.
        try:
            self.step_cost = self._calibrate(self.runner)
            tiers = open_tiers(config, self.runner.pool, self.model_dir)  # `--kv-host-memory`, `--kv-disk-path`
        except BaseException:
            self.runner.close(graceful=False)  # no tensor-parallel worker outlives a failed start
            raise
        self.target_step_secs = _target_step_secs(config, self.device)
        self.step_budget = StepBudget(
            config.max_num_batched_tokens, self.target_step_secs, config.block_size, self.step_cost
        )
        self.counters = EngineCounters()
        self.kv = KVManager(
            self.runner.pool,
            max_num_seqs=config.admission.max_num_seqs,
            max_model_len=self.max_model_len,
            prefix_cache=config.prefix_cache,
            retention_secs=config.prefix_retention_secs,
            tiers=tiers,
        )
        self.admission = AdmissionController(
            config.admission,
            Capacity(config.block_size, self.first_num_blocks, self.max_model_len),
            rates=self.step_cost.rates(),
            wakeup=self._wake,
            reload_status=self.health.reload_seconds_left,
            kv=self.kv,
        )
        self.recovery = FaultRecovery(
            lambda: self._load_runner(),  # looked up at each reload (tests replace the loader)
            self.health,
            first_num_blocks=self.first_num_blocks,
            max_retries=config.max_fault_retries,
            backoff_secs=config.fault_backoff_secs,
            device_type=self.device.type,
        )
        self._adaptive = config.admission.policy == "adaptive"
        # `--speculative`: drafts from each request's own tokens (and its session's outputs), verified in the step.
        self.drafter: Drafter | None = None
        if config.speculative != "off":
            self.drafter = Drafter(
                config.speculative, config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
            )
        # HELEXA_FAULT_INJECT fires here (rank 0), or on the worker rank HELEXA_FAULT_INJECT_RANK names.
        self._faults = FaultInjector.from_env() if fault_rank == 0 else FaultInjector()
        self._last_end: float | None = None  # when the previous step that ran the model ended (None: idle since)
        self._step_no = 0  # steps that ran the model, counted from 1 (HELEXA_FAULT_INJECT counts these)
        self._preempted: dict[int, Sequence] = {}  # by ticket id: blocks freed, waiting in admission to resume
        self._running: list[Sequence] = []  # in admission order: the last is the most recently admitted
        # Granted, held back until a running request has computed more of their prompt (see `_hold_back`).
        self._deferred: dict[int, tuple[Ticket, str, int]] = {}  # ticket id -> (ticket, source request id, blocks)
        self._pending: dict[str, RequestHandle] = {}  # submitted, not ended; any thread, under _lock
        self._aborts: set[str] = set()  # abort requests for running sequences, under _lock
        self._flushes: list[Future[int]] = []  # `flush_prefix_cache` calls waiting for the loop, under _lock
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._wakeup = threading.Condition()  # its own lock: admission calls _wake while _lock may be held
        self._woken = False
        self._closed = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.request_sizes = RequestSizes()  # recent admitted sizes: what a median one would wait is a metric
        self.kv_events: KVEventRecorder | None = None  # `--kv-events-endpoint`: what the prefix cache stores, evicts
        if config.kv_events_endpoint is not None:
            from helexa.cluster import KVEventRecorder, pool_medium

            self.kv_events = KVEventRecorder.open(
                config.kv_events_endpoint, replay_endpoint=config.kv_events_replay_endpoint,
                topic=config.kv_events_topic or "", block_size=config.block_size,
                medium=pool_medium(torch.device(self.device).type), tagged_maps=config.kv_events_encoding == "map",
                queue_batches=config.kv_events_queue_batches, buffer_batches=config.kv_events_buffer_batches,
            )  # fmt: skip
            self.kv_events.start(self.kv.prefix_cache, self.kv.tiers)
        trim_heap("engine: loaded")  # what loading and calibration freed leaves the resident set
        self.heap = HeapLevel()  # and what the steps free is handed back whenever it has piled up
        self.load_seconds = time.perf_counter() - load_start
        logger.info(
            f"engine: loaded {self.model_name} on {self.device} {_dtype_name(self.dtype)} in {self.load_seconds:.2f}s; "
            f"max_model_len={self.max_model_len} max_num_seqs={config.admission.max_num_seqs} "
            f"max_num_batched_tokens={config.max_num_batched_tokens} target_step_secs={self.target_step_secs:g} "
            f"attention={config.attention_backend} tensor_parallel_size={config.tensor_parallel_size}"
        )

    def _calibrate(self, runner: ModelRunner) -> MeasuredStepCost:
        """The step costs estimates start from, measured on this model and device before any request."""
        measured = runner.calibrate(min(256, self.config.max_num_batched_tokens), 8, self.max_model_len)
        if measured is None:
            logger.info("engine: pool too small to calibrate on; estimates start from the priors")
            return MeasuredStepCost()
        decode, prefill = measured
        logger.info(f"engine: calibrated decode_step={decode * 1e3:.2f}ms prefill={prefill * 1e6:.1f}us/token")
        return MeasuredStepCost.calibrated(decode, prefill)

    def _load_runner(self) -> ModelRunner:
        """The model and its KV pool, loaded from the config (at start and on every reload)."""
        loaded = load(
            self.config,
            self.model_dir,
            self.model_config,
            self.dtype,
            self.device,
            self.max_model_len,
            self.tokenizer.vocab_size,
            # `--kv-cache-dtype fp8`: the fp8 scales are calibrated on this text at every load
            calibration_ids=kv_calibration_ids(self.tokenizer) if self.config.kv_cache_dtype != "auto" else None,
        )
        runner = ModelRunner(loaded)
        if self.device.type == "cuda" and not self.config.enforce_eager:
            runner.use_cuda_graphs(self.config.admission.max_num_seqs, self.max_model_len)
        return runner

    @property
    def budget(self) -> KVBudget:
        """The KV budget of the loaded pool (its block count never changes across reloads)."""
        return self._live_runner().budget

    @property
    def pool(self) -> BlockPool:
        """The KV block pool (rebuilt with the same block count after a device fault)."""
        return self.kv.pool

    def _live_runner(self) -> ModelRunner:
        if self.runner is None:
            raise RuntimeError(f"the model is not loaded (state: {self.health.state})")
        return self.runner

    # ------------------------------------------------------------------ requests (any thread)

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        cache_salt: str | None = None,
        prompt_cache_key: str | None = None,
    ) -> RequestHandle:
        """Queue a tokenised request for generation; thread-safe.

        `params.max_tokens=None` lets admission grant the node's default. The prefix cache shares
        blocks only between requests with the same `cache_salt` (or none); a `prompt_cache_key` names
        an agent session whose blocks are retained when the request ends. Raises `AdmissionRejected`
        (never fits, queue full, wait beyond the deadline), `ValueError` (empty prompt, token ids
        outside the vocabulary, bad params), `DeviceFault` (the node gave up) or `EngineClosed`.
        """
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if not prompt_ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        for name, value in (("cache_salt", cache_salt), ("prompt_cache_key", prompt_cache_key)):
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a string, got {type(value).__name__}")
        if len(prompt_ids) >= self.max_model_len:  # can never run: admission says so without a pass over the ids
            self.admission.submit(len(prompt_ids), params.max_tokens, stops_early=not params.runs_to_limit)
        constraint = self.grammar_tokenizer.constraint(params.grammar) if params.grammar is not None else None
        prompt = [int(t) for t in prompt_ids]
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        with self._lock:
            if self.health.fault_cause is not None:
                raise DeviceFault(self.health.fault_cause)
            if self._closed:
                raise EngineClosed("the engine is shutting down and admits no new requests")
            request_id = request_id or f"req-{next(self._ids)}"
            if request_id in self._pending:
                raise ValueError(f"request id {request_id!r} is already in use")
            req = Request(
                request_id, prompt, params, RequestStream(request_id), cache_salt, prompt_cache_key, constraint
            )
            self.kv.open(request_id, req.prompt, salt=cache_salt, session=prompt_cache_key)
            try:
                ticket = self.admission.submit(
                    len(prompt), params.max_tokens, stops_early=not params.runs_to_limit, request_id=request_id
                )
            except BaseException:
                self.kv.close(request_id)  # a rejected request never holds a block, nor a registration
                raise
            handle = RequestHandle(request_id, req.stream, len(prompt), ticket.max_tokens, ticket, req)
            self.request_sizes.observe(len(prompt), ticket.max_tokens)
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

    def flush_prefix_cache(self, timeout: float = 10.0) -> int:
        """Evict every cached block no request holds (and every block of the tiers below the pool), on the loop's
        thread at its next step boundary; returns how many pool blocks were evicted. Blocks in use (running,
        preempted-and-pinned, deferred) are never touched, so no request loses its KV; KV event subscribers hear
        each eviction. Raises `TimeoutError` when the loop does not reach a step boundary within `timeout` seconds
        (a poisoned or reloading engine)."""
        done: Future[int] = Future()
        with self._lock:
            self._flushes.append(done)
        self._wake()
        return done.result(timeout)

    def snapshot(self) -> dict[str, Any]:
        """The `/v1/admission` body: pool and admission numbers, the KV tiers' contents, speculative decoding's
        totals (zero when it is off), recomputed tokens, the prefill chunk budget and the model state."""
        tiers = self.kv.tiers
        return {
            **self.admission.snapshot(),
            **(tiers.snapshot() if tiers is not None else KVTiers.NONE),
            **(self.drafter.stats if self.drafter is not None else SpecStats()).snapshot(),
            "recomputed_tokens": self.counters.recomputed_tokens,
            "target_step_secs": self.target_step_secs,
            "prefill_chunk_tokens": self.step_budget.chunk_tokens,
            "model_state": self.health.state,
        }

    def view(self) -> EngineView:
        """One typed reading for the operator page: admission's view and its `/v1/admission` body, then the KV
        owner's survey (None while no pool is loaded) and the budget line. Any thread; for display, never
        bookkeeping (`EngineView.consistent` says whether the two readings still agree)."""
        admission = self.admission.view()
        snapshot = {**self.snapshot(), **admission.snapshot}  # the engine's own fields around admission's reading
        try:
            survey = self.kv.survey()
        except RuntimeError:  # reloading: no pool to survey
            survey = None
        runner = self.runner
        return EngineView(admission, snapshot, survey, runner.budget.describe() if runner is not None else None)

    # ------------------------------------------------------------------ the loop

    def step(self) -> bool:
        """One engine step: admit, schedule, run, sample, stream. Returns False when there was nothing to run.

        A failure while running the batch is a device fault: it is logged with its cause, the model
        and pool are rebuilt with the same config, and the running sequences are replayed.
        """
        begin, self._last_end = self._last_end or time.perf_counter(), None
        if self.health.fault_cause is not None or self.runner is None:
            return False
        self._take_admitted()
        self._release_deferred()
        self._apply_aborts()
        self._apply_flushes()
        loaded, load_seconds = self._load_phase()
        drafts = self._propose_drafts() if self.drafter is not None else None
        computing = [s for s in self._running if not s.loading]
        chunks = schedule(computing, self.config.max_num_batched_tokens, self.step_budget.prefill_limit, drafts)
        if self._adaptive:
            chunks = self._provision(chunks)
        if not chunks:
            return loaded > 0  # a step that only loaded worked: the loop comes straight back
        self._step_no += 1
        t0 = time.perf_counter()
        try:
            attn = self.kv.build_step([(c.seq.request_id, c.num_new) for c in chunks])  # evict, then grow tables
            inputs = self.runner.prepare(chunks, attn)
            for chunk in chunks:
                chunk.seq.num_computed += chunk.num_new
            t1 = time.perf_counter()
            self._faults.check(self._step_no)
            sampled = self.runner.execute(inputs, self._step_no)
        except Exception as exc:  # any failure on the device side: recover and replay
            self._on_device_fault(exc, chunks)
            return True
        t2 = time.perf_counter()
        self.recovery.succeeded()
        self.counters.prefix_cache_evictions = self.kv.evictions
        finished = self._postprocess(inputs, sampled)
        # every block the step filled is now computed: offer it to the prefix cache
        self.kv.offer_all((chunk.seq.request_id, chunk.seq.num_computed) for chunk in chunks)
        for seq, event in finished:
            self._finish(seq, event)
        if self.kv_events is not None:  # this step's stored and evicted blocks, as one batch (never blocks)
            self.kv_events.end_step()
        t3 = time.perf_counter()
        # The rate estimates are made from the loop's cadence: from the end of the previous working step
        # (back to back under load) to the end of this one, so the loop's own overhead and the threads
        # it shares the interpreter with are in it, as they are in every real wait.
        self._record(inputs, t3 - begin - load_seconds, t3 - t0, t2 - t1, _decode_yield(inputs, sampled))
        self.heap.check()  # outside the step's timing: a trim, when one runs, is the loop's overhead
        self._last_end = t3
        return True

    def has_work(self) -> bool:
        """True while any request is running or waiting for admission."""
        busy = self._running or self._preempted or self._deferred or self._pending
        return bool(busy) or self.admission.queue_depth > 0

    def start(self) -> None:
        """Run the loop on a daemon thread until `shutdown`."""
        if self._thread is not None:
            raise RuntimeError("the engine loop is already running")
        self._thread = threading.Thread(target=self._loop, name="helexa-engine", daemon=True)
        self._thread.start()

    def shutdown(self, grace_seconds: float = 0.0) -> None:
        """Stop admitting, let running requests finish for up to `grace_seconds`, abort the rest, stop the loop,
        then stop every tensor-parallel worker (each one exited and reaped when this returns)."""
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
        if self._thread is None:
            self.step()
        else:
            bound = time.monotonic() + 30
            while self.has_work() and time.monotonic() < bound and self._thread.is_alive():
                time.sleep(0.01)
            with self._wakeup:
                self._stopping = True
                self._wakeup.notify_all()
            self._thread.join(timeout=30)
            self._thread = None
        if self.runner is not None:
            self.runner.close()  # tensor-parallel workers stop; the pool stays readable for the last snapshot
        if self.kv_events is not None:
            self.kv_events.close()  # sends what is queued, then closes its sockets
        if self.kv.tiers is not None:
            self.kv.tiers.close()  # the disk tier's queued writes finish

    def check_integrity(self) -> None:
        """Engine-level invariants: the KV owner's (every in-use block charged to exactly one request or
        orphaned, every table's blocks held for it) and admission's (each reservation covers the blocks its
        request is charged for); each running table covers exactly the computed tokens; preempted
        sequences hold no blocks and wait in admission (or were just regranted); the KV owner knows exactly
        the requests that have not ended."""
        self.kv.check_integrity()
        self.admission.check_integrity()
        for seq in self._running:
            if self.kv.num_tokens(seq.request_id) != seq.num_computed:
                raise AssertionError(
                    f"{seq.request_id}: block table covers {self.kv.num_tokens(seq.request_id)} tokens, "
                    f"{seq.num_computed} computed"
                )
        for seq in self._preempted.values():
            holding = self.kv.holding(seq.request_id)
            # Regranted and not yet resumed, it may hold the prefix hit its grant pinned (often its own
            # blocks from before the preemption, cached since); waiting, it holds nothing.
            regranted = seq.ticket.state is TicketState.GRANTED
            if holding is None or holding.running or seq.num_computed or seq.ticket.state.ended:
                raise AssertionError(f"{seq.request_id}: preempted but runs, has computed tokens or has ended")
            if holding.block_ids and not regranted:
                raise AssertionError(f"{seq.request_id}: preempted and waiting, but holds blocks {holding.block_ids}")
        with self._lock:
            pending, known = set(self._pending), set(self.kv.keys())
        if pending != known:
            raise AssertionError(
                f"KV owner's requests {sorted(known - pending)} have ended; {sorted(pending - known)} are unknown to it"
            )

    # ------------------------------------------------------------------ step phases

    def _take_admitted(self) -> None:
        """Turn newly granted tickets into running sequences (starting from their prefix-cache hit);
        end expired and cancelled ones."""
        polled = self.admission.poll()
        for ticket in polled.expired:
            handle = self._pending.get(ticket.request_id or "")
            if handle is not None:
                self._end_unstarted(handle, TokenEvent(finish_reason="error", error=ticket.error))
        for ticket in polled.granted:
            held_back = self._hold_back(ticket)
            if held_back is not None:
                self._deferred[ticket.id] = (ticket, *held_back)
            else:
                self._begin(ticket)
        for ticket in polled.cancelled:
            with self._lock:
                self._aborts.add(ticket.request_id or "")

    def _begin(self, ticket: Ticket) -> None:
        """Start a granted ticket: a new sequence, or a preempted one resuming (recomputing what the cache no
        longer holds), from a block table that begins with the hit pinned at its grant."""
        seq = self._preempted.pop(ticket.id, None)
        if seq is None:
            with self._lock:  # `submit` may still be storing the handle of a ticket granted at once
                req = self._pending[ticket.request_id or ""].request
            seq = Sequence(
                request=req,
                ticket=ticket,
                token_ids=list(req.prompt),
                detokenizer=IncrementalDetokenizer(self.tokenizer, req.prompt, req.params.skip_special_tokens),
                stop_checker=StopChecker(req.params.stop),
                generator=make_generator(req.params.seed, self.device) if req.params.seed is not None else None,
            )
        seq.num_computed = self.kv.start(seq.request_id, seq.token_ids)
        seq.loading = self.kv.tiers is not None  # what a tier holds after the hit is loaded by `_load_phase`
        self._running.append(seq)
        if ticket.preemptions:
            self.counters.recomputed_tokens += max(0, seq.dropped_tokens - seq.num_computed)
        elif self.kv.prefix_caching:
            seq.cached_tokens = seq.num_computed
            self.counters.prefix_cache_query_tokens += seq.prompt_len
            self.counters.prefix_cache_hit_tokens += seq.cached_tokens
            logger.debug(
                "engine: prefix cache request=%s prompt=%d hit_tokens=%d computed=%d shared_blocks=%d",
                seq.request_id, seq.prompt_len, seq.cached_tokens, seq.prompt_len - seq.cached_tokens,
                self.kv.shared_blocks(seq.request_id),
            )  # fmt: skip
        self._refit(seq)  # a hit a reload dropped is computed, and so reserved, by the sequence itself

    def _load_phase(self) -> tuple[int, float]:
        """Tier loads, scheduled like prefill chunks: each loading sequence (sessions first) copies the next
        full blocks of its prompt that a tier below the pool holds into new blocks of its reservation, instead of
        computing them, until a load finds no more; it computes nothing until then. While other sequences
        decode, a step loads at most `StepBudget.load_limit` blocks (at the measured read time per block), so a
        long session coming back never stalls their tokens for more than a step's worth. Returns the tokens
        loaded and the seconds it took (left out of the step cadence the decode and prefill rates are measured
        from: loads have their own rate)."""
        tiers = self.kv.tiers
        # sessions (a `prompt_cache_key`: the agents whose blocks a tier keeps longest) load first, then the rest,
        # each group in admission order
        loading = sorted((s for s in self._running if s.loading), key=lambda s: s.request.session is None)
        if tiers is None or not loading:
            return 0, 0.0
        t0, bs = time.perf_counter(), self.config.block_size
        decoding = sum(1 for s in self._running if not s.loading and not s.in_prefill)
        budget = self.step_budget.load_limit(decoding, tiers.load_seconds_per_block)
        total = 0
        for seq in loading:
            room = min(budget, seq.ticket.blocks_reserved - self.kv.charged_blocks(seq.request_id))
            n = self.kv.load_from_tiers(seq.request_id, room) if room > 0 else 0
            seq.num_computed += n
            total += n
            budget -= n // bs
            if not seq.ticket.preemptions:
                seq.cached_tokens += n
                self.counters.prefix_cache_hit_tokens += n
            if n < room * bs or room <= 0:
                seq.loading = False  # the tiers hold nothing more after it (or it has no room for more)
            left = max(0, seq.ticket.prompt_loadable - n) if seq.loading else 0
            self.admission.progress(
                seq.ticket, prompt_prefilled=min(seq.num_computed, seq.prompt_len), prompt_loadable=left
            )
            if budget <= 0:
                break
        seconds = time.perf_counter() - t0
        if total:
            self._publish_rates()
        return total, seconds

    def _hold_back(self, ticket: Ticket) -> tuple[str, int] | None:
        """`(source request, blocks)` when a running request is prefilling more full blocks of this new request's
        prompt than its hit holds (the choices of one `n > 1` request, or concurrent turns of one session):
        the request then waits for the source to compute `blocks` of them, and shares them instead of
        computing them again. None: start now."""
        if not self.kv.prefix_caching or ticket.preemptions or ticket.id in self._deferred:
            return None
        prefilling = [s.request_id for s in self._running if s.in_prefill]
        return self.kv.source_for(ticket.request_id or "", prefilling) if prefilling else None

    def _release_deferred(self) -> None:
        """Start held-back requests whose source has offered the blocks they wait for (or stopped running);
        each measures its hit again first, so what it now shares is not reserved twice."""
        if not self._deferred:  # (most steps: no set of the running ids to build)
            return
        running = {s.request_id for s in self._running}
        for tid, (ticket, source, blocks) in list(self._deferred.items()):
            waiting = source in running and self.kv.offered_blocks(source) < blocks
            if waiting or ticket.cancel_requested:  # (a cancelled one ends in `_apply_aborts`)
                continue
            del self._deferred[tid]
            self.admission.reshare(ticket)
            self._begin(ticket)

    def _refit(self, seq: Sequence) -> None:
        """Make a running sequence's reservation cover every block it will be charged for (after a reload it
        shares nothing), preempting the most recently admitted sequences while the pool is short (possibly
        this one)."""
        while seq.ticket.state is TicketState.GRANTED and not self.admission.refit(seq.ticket):
            victim = self._running[-1]
            self._preempt(victim)
            if victim is seq:
                return

    def _apply_aborts(self) -> None:
        with self._lock:
            if not self._aborts:
                return
            aborts, self._aborts = self._aborts, set()
        for seq in [s for s in [*self._running, *self._preempted.values()] if s.request_id in aborts]:
            self._finish(seq, _final(seq, "abort"))
        for tid, (ticket, _, _) in list(self._deferred.items()):
            if ticket.request_id in aborts:  # held back, never started: its reservation and pins return
                self._end_deferred(tid, TokenEvent(finish_reason="abort"))

    def _apply_flushes(self) -> None:
        with self._lock:
            if not self._flushes:
                return
            flushes, self._flushes = self._flushes, []
        evicted = self.kv.clear_cache()  # held blocks stay: only unheld ones are evicted (and every tier's)
        self.counters.prefix_cache_evictions = self.kv.evictions
        if self.kv_events is not None:  # the evictions go out now, not with the next working step
            self.kv_events.end_step()
        for done in flushes:
            done.set_result(evicted)

    def _end_deferred(self, ticket_id: int, final: TokenEvent) -> None:
        ticket = self._deferred.pop(ticket_id)[0]
        self.admission.release(ticket)
        handle = self._pending.get(ticket.request_id or "")
        if handle is not None:
            self._end_unstarted(handle, final)

    def _postprocess(self, inputs: StepInputs, sampled: StepSamples | None) -> list[tuple[Sequence, TokenEvent]]:
        """Append each sequence's emitted tokens (a verified draft's kept tokens, then the next one), stream
        their events, and return the sequences that ended with their final event (the caller ends them once
        their blocks are offered).

        A sequence whose draft was cut short forgets the rejected positions' slots first, so its table
        covers exactly its computed tokens; a sequence that ends inside its emitted tokens drops the rest
        (they were never shown). The streams' async consumers are woken after the step's last event, each
        event loop once (not once per event), also when this raises. The whole step's progress reaches
        admission before any sequence is released, so its wait estimates never see half a step.
        """
        finished: list[tuple[Sequence, TokenEvent]] = []
        wakeups = Wakeups()
        try:
            generated = self._emit(inputs, sampled, finished, wakeups) if sampled is not None else 0
        finally:
            wakeups.wake()
        self.counters.generation_tokens += generated
        ending = {id(seq) for seq, _ in finished}
        self.admission.progress_all(
            (seq.ticket, min(seq.num_computed, seq.prompt_len), seq.num_output)
            for seq in self._running
            if id(seq) not in ending
        )
        return finished

    def _emit(
        self, inputs: StepInputs, sampled: StepSamples, finished: list[tuple[Sequence, TokenEvent]], wakeups: Wakeups
    ) -> int:
        """`_postprocess`'s tokens: append and stream each group's emitted tokens (their consumers' wake-ups owed
        to `wakeups`), add the sequences that ended to `finished`; returns the number of tokens appended."""
        eos, token_ids, generated = self.tokenizer.eos_token_ids, sampled.samples.token_ids, 0
        for gi, group in enumerate(inputs.groups):
            seq = group.seq
            if gi in sampled.failures:  # this request's own parameters broke its sampling
                error = RequestFailed(
                    f"sampling failed for this request: {type(sampled.failures[gi]).__name__}: {sampled.failures[gi]}"
                )
                logger.warning("engine: request %s failed in sampling: %s", seq.request_id, error)
                finished.append((seq, _final(seq, "error", error)))
                continue
            emitted = sampled.emitted[gi]
            if group.draft:
                self._settle_draft(seq, len(group.draft), emitted - 1)
            constraint, stream = seq.constraint, seq.stream
            for row in range(group.row, group.row + emitted):
                if constraint is not None:  # the mask allowed it: the grammar moves on
                    constraint.accept(token_ids[row])
                event = append_token(seq, sampled.samples, row, eos)
                generated += 1
                if event.finished:
                    finished.append((seq, event))
                    seq.num_computed = min(seq.num_computed, seq.num_tokens)  # only the tokens it kept
                    break
                stream.put(event, wakeups)
        return generated

    def _propose_drafts(self) -> dict[Sequence, tuple[int, ...]]:
        """Speculative decoding: the draft each decoding sequence verifies this step; none while a prompt is
        being prefilled (its step stays as short as it would be without drafts, so time to first token does
        not pay for them). A draft never needs a slot beyond the request's reservation (nor its context),
        and never takes the output past its granted limit: a request near either drafts less. A
        structured-output request drafts only what its grammar allows."""
        drafter, block_size = self.drafter, self.config.block_size
        assert drafter is not None
        if any(s.in_prefill for s in self._running):  # a prompt waiting for its first token is not slowed by drafts
            return {}
        decoding = [s for s in self._running if s.num_tokens - s.num_computed == 1 and not s.in_prefill]
        # What one verified row costs against what one more token of a decoding request is worth: a row adds
        # what the steps that verified drafts measured (before any, what a prompt token adds); a kept token
        # saves its request a step, whose time the step's decodes share.
        est = self.step_cost.estimate()
        row_cost = est.row_seconds * len(decoding) / max(est.decode_seconds, 1e-9)
        drafts: dict[Sequence, tuple[int, ...]] = {}
        for seq in decoding:
            if not seq.params.speculative:
                continue
            if seq.draft_state is None:
                seq.draft_state = drafter.new_state()
            room = (seq.ticket.blocks_reserved + self.kv.shared_blocks(seq.request_id)) * block_size - seq.num_tokens
            limit = min(room, seq.granted_max_tokens - seq.num_output - 1, self.max_model_len - seq.num_tokens)
            draft = drafter.propose(
                seq.token_ids, seq.draft_state, limit, seq.request.cache_salt, seq.request.session, row_cost
            )
            if draft and seq.constraint is not None:
                draft = draft[: seq.constraint.valid_prefix(draft)]
            if draft:
                drafts[seq] = draft
        return drafts

    def _settle_draft(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """A verified draft kept its first `accepted` tokens: the rejected positions' slots are forgotten (their
        blocks, never offered, return to the pool) and the request's next draft length adapts."""
        assert self.drafter is not None and seq.draft_state is not None
        seq.num_computed -= drafted - accepted
        if accepted < drafted:
            self.kv.trim(seq.request_id, seq.num_computed)
        self.drafter.verified(seq.draft_state, drafted, accepted)

    def _provision(self, chunks: list[ScheduledChunk[Sequence]]) -> list[ScheduledChunk[Sequence]]:
        """Policy adaptive: grow each scheduled sequence's reservation to cover its chunk, oldest first.

        While the pool has too few blocks available, the most recently admitted sequence is preempted
        (possibly the one asking). Returns the chunks of the sequences still running; afterwards every
        one of them has its blocks reserved, so the step's tables never run out.
        """
        block_size, by_seq = self.config.block_size, {id(c.seq): c for c in chunks}
        for seq in list(self._running):
            chunk = by_seq.get(id(seq))
            if chunk is None or seq.ticket.id in self._preempted:
                continue
            need = -(-(seq.num_computed + chunk.num_new) // block_size) - self.kv.shared_blocks(seq.request_id)
            while need > seq.ticket.blocks_reserved and not self.admission.grow(seq.ticket, need):
                victim = self._running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
        return [c for c in chunks if c.seq.ticket.id not in self._preempted]

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and hand its reservation back; it resumes when admission regrants it."""
        self._running.remove(seq)
        self.counters.preemptions += 1
        self.kv.drop_table(seq.request_id)
        seq.dropped_tokens, seq.num_computed = seq.num_computed, 0
        self._preempted[seq.ticket.id] = seq
        self.admission.preempt(seq.ticket)  # its cache holds go with the reservation

    def _finish(self, seq: Sequence, final: TokenEvent) -> None:
        """End a running (or preempted) sequence: its blocks and reservation return, its stream gets the final
        event, and a natural end or the length limit teaches admission one answer length."""
        if self._preempted.pop(seq.ticket.id, None) is None:
            self._running.remove(seq)
        self.kv.drop_table(seq.request_id)  # its own blocks; those it shares go with the reservation
        if self.drafter is not None and final.finish_reason in ("stop", "length"):  # a session's next turns may copy it
            self.drafter.finished(seq.request.cache_salt, seq.request.session, seq.output_ids)
        if seq.ticket.state is TicketState.QUEUED:  # preempted, waiting to resume
            self.admission.cancel(seq.ticket)
        else:
            self.admission.release(seq.ticket, finish_reason=final.finish_reason, output_tokens=seq.num_output)
        self._forget(seq.request_id)
        seq.stream.put(final)

    def _end_unstarted(self, handle: RequestHandle, final: TokenEvent) -> None:
        if self._preempted.pop(handle.ticket.id, None) is not None and handle.ticket.state is TicketState.GRANTED:
            self.admission.release(handle.ticket)  # preempted, regranted, never resumed: its blocks return
        self._forget(handle.request_id)
        handle.stream.put(final)

    def _forget(self, request_id: str) -> None:
        """The request has ended: the KV owner and the engine forget it."""
        with self._lock:
            self.kv.close(request_id)
            self._pending.pop(request_id, None)
            self._aborts.discard(request_id)

    def _record(
        self,
        inputs: StepInputs,
        cadence_seconds: float,
        step_seconds: float,
        model_seconds: float,
        decode_yield: float = 1.0,
    ) -> None:
        """Counters get the step's own time; the cost model gets the loop's cadence (see `step`) and what each
        decoding sequence gained in it (`decode_yield` tokens: more than one where drafts were kept)."""
        self.counters.steps += 1
        self.counters.step_seconds += step_seconds
        self.counters.model_seconds += model_seconds
        self.counters.prompt_tokens += inputs.num_prefill_tokens
        self.step_budget.observe(
            cadence_seconds, inputs.num_decode_tokens, inputs.num_prefill_tokens, decode_yield, inputs.num_draft_tokens
        )
        self._publish_rates()

    def _publish_rates(self) -> None:
        """Hand admission the measured step costs, and the tiers' measured load cost per token once there is one."""
        rates = self.step_cost.rates()
        tiers = self.kv.tiers
        per_block = tiers.load_seconds_per_block if tiers is not None else None
        if per_block is not None:
            rates = replace(rates, load_token_seconds=per_block / self.config.block_size)
        self.admission.set_rates(rates)

    # ------------------------------------------------------------------ device faults

    def _on_device_fault(self, exc: BaseException, chunks: list[ScheduledChunk[Sequence]]) -> None:
        """Drop what lived in the pool, let `FaultRecovery` reload the model (or give up), then replay."""
        batch = f"{len(chunks)} sequences, {sum(c.num_new for c in chunks)} tokens"
        if self.kv_events is not None:  # every cached block goes with the pool
            self.kv_events.cache_dropped(self.kv.prefix_cache)
        self.kv.reset(None)  # pins and holds were in the pool being dropped
        old, self.runner = self.runner, None  # drop the model and the pool, and give their device memory back
        if old is not None:  # tensor parallelism: every worker stops; the reload respawns the group
            old.close(graceful=False)
        del old
        outcome = self.recovery.recover(exc, f"step {self._step_no} (batch: {batch})")
        self.counters.device_faults, self.counters.model_reloads = self.recovery.faults, self.recovery.reloads
        if outcome.runner is None:
            self._give_up(outcome.cause)
            return
        self.runner = outcome.runner
        self.heap.reset()  # the reload trimmed: its resident set is the new level
        self.kv.reset(self.runner.pool)
        if self.kv_events is not None:
            self.kv_events.attach(self.kv.prefix_cache)
        self._replay()
        logger.warning(
            f"engine: reloaded after device fault in {self.health.last_reload_seconds:.2f}s "
            f"({self.runner.budget.num_blocks} KV blocks, as at first load); replaying {len(self._running)} sequences"
        )

    def _replay(self) -> None:
        """Every running sequence recomputes its prompt and the tokens it generated so far into the new, empty
        pool; reservations in admission survive, grown where they had shared blocks."""
        for seq in self._running:
            seq.num_computed = self.kv.start(seq.request_id, seq.token_ids)
            seq.loading = self.kv.tiers is not None  # the tiers outlive the pool: what they hold is loaded again
            self.admission.progress(seq.ticket, prompt_prefilled=0)
        for seq in list(self._running):
            if seq in self._running:
                self._refit(seq)
        for tid in list(self._deferred):  # their pins were in the dropped pool: they start (and refit) now
            self._begin(self._deferred.pop(tid)[0])

    def _give_up(self, cause: str) -> None:
        """Stay poisoned: fail running and queued requests with `DeviceFault`; refuse new ones."""
        logger.error("engine: model poisoned for good: %s", cause)
        error = DeviceFault(cause)
        with self._lock:
            self.health.give_up(cause)
        for seq in list(self._running):
            self._finish(seq, _final(seq, "error", error))
        for tid in list(self._deferred):
            self._end_deferred(tid, TokenEvent(finish_reason="error", error=error))
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
                logger.exception("engine: step failed outside the model with %d running sequences", len(self._running))
                error = EngineError(f"engine error: {type(exc).__name__}: {exc}")
                for seq in list(self._running):
                    self._finish(seq, _final(seq, "error", error))
                worked = True
            if worked:
                continue
            deadline = self.admission.next_deadline()
            timeout = 0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))
            with self._wakeup:
                if not self._woken and not self._stopping:
                    self._wakeup.wait(timeout)
                self._woken = False


def _decode_yield(inputs: StepInputs, sampled: StepSamples | None) -> float:
    """Tokens each decoding sequence gained in the step, on average: 1, plus the draft tokens kept."""
    if sampled is None or inputs.num_decode_seqs == 0:
        return 1.0
    kept = sum(sampled.emitted[i] - 1 for i, g in enumerate(inputs.groups) if g.draft)
    return 1.0 + kept / inputs.num_decode_seqs


def _final(seq: Sequence, reason: str, error: BaseException | None = None) -> TokenEvent:
    return TokenEvent(
        finish_reason=reason, error=error, num_prompt_tokens=seq.prompt_len, num_output_tokens=seq.num_output
    )


def _max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    limit = model_config.max_model_len
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(f"--max-model-len {config.max_model_len} exceeds the model's max_position_embeddings {limit}")
    return config.max_model_len


def _target_step_secs(config: EngineConfig, device: torch.device) -> float:
    """The step time prefill chunks are sized to while requests decode: the config's, else 0.5 s on CPU, 0 (off)
    on CUDA, where a full chunk takes well under a second."""
    if config.target_step_secs is not None:
        return float(config.target_step_secs)
    return 0.5 if device.type == "cpu" else 0.0


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA device is available")
    return torch.device(name)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
