"""Property tests: the controller against a plain model of the admission rules, and backfill's promise.

The model re-implements the rules the obvious way (lists, an O(n^2) release scan for the wait
estimate) so a bug in the controller's incremental plan or bookkeeping shows up as a mismatch.
Rates are whole and half seconds, so every estimate is an exact float on both sides.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from helexa.admission import AdmissionRejected, EngineRates, TicketState, retry_after_seconds
from tests.support.admission import FakeClock, FakeEngine, FixedKV, SeqWork, controller, estimate_starts

BS, NB, MML, SEQS, QD, WAIT, DEFAULT_MAX = 4, 24, 64, 3, 3, 30.0, 16
RATES = EngineRates(decode_step_seconds=1.0, prefill_token_seconds=0.25)


@dataclass
class Req:
    id: int
    blocks: int
    prompt: int
    max_tokens: int
    shared: int
    deadline: float
    generated: int = 0
    prefilled: int = 0
    cancel_requested: bool = False
    seen: bool = False

    @property
    def run_seconds(self) -> float:
        return (self.prompt - self.prefilled) * 0.25 + (self.max_tokens - self.generated) * 1.0


class AdmissionMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock(100.0)
        self.c = controller(
            BS,
            NB,
            MML,
            max_num_seqs=SEQS,
            max_queue_depth=QD,
            max_wait_secs=WAIT,
            default_max_tokens=DEFAULT_MAX,
            replan_interval_secs=0.0,
            clock=self.clock,
            rates=RATES,
            kv=FixedKV(BS, NB),
            debug=True,
        )
        self.tickets = {}  # id -> Ticket
        self.queue: list[Req] = []
        self.running: dict[int, Req] = {}  # granted, in grant order
        self.engine: list[int] = []  # ids the engine runs (seen, not yet released)
        self.pending_grants: list[int] = []
        self.pending_cancels: list[int] = []

    # ---------------------------------------------------------------- the model of the rules

    def reserved(self) -> int:
        return sum(r.blocks for r in self.running.values())

    def pump(self) -> None:
        while self.queue and self.queue[0].blocks <= NB - self.reserved() and len(self.running) < SEQS:
            r = self.queue.pop(0)
            self.running[r.id] = r
            self.pending_grants.append(r.id)

    def end(self, rid: int) -> None:
        del self.running[rid]
        if rid in self.pending_grants:
            self.pending_grants.remove(rid)
        self.pump()

    def starts(self, now: float, waiting: list[tuple[int, float]]) -> list[float]:
        events = sorted((now if r.cancel_requested else now + r.run_seconds, r.blocks) for r in self.running.values())
        avail, slots, t, out = NB - self.reserved(), SEQS - len(self.running), now, []
        for blocks, run in waiting:
            for k in range(len(events) + 1):
                if avail + sum(b for _, b in events[:k]) >= blocks and slots + k >= 1:
                    break
            t = max(t, events[k - 1][0]) if k else t
            avail += sum(b for _, b in events[:k]) - blocks
            slots += k - 1
            events = events[k:]
            bisect.insort(events, (t + run, blocks))
            out.append(t)
        return out

    def queue_work(self) -> list[tuple[int, float]]:
        return [(r.blocks, r.run_seconds) for r in self.queue]

    # ---------------------------------------------------------------- rules

    @rule(prompt=st.integers(1, 70), max_tokens=st.one_of(st.none(), st.integers(1, 24)), shared=st.integers(0, 2))
    def submit(self, prompt: int, max_tokens: int | None, shared: int) -> None:
        shared = min(shared, (prompt - 1) // BS)
        now = self.clock.t
        m = max_tokens if max_tokens is not None else max(1, min(MML - prompt, DEFAULT_MAX))
        blocks = -(-(prompt + m) // BS) - shared
        req = Req(0, blocks, prompt, m, shared, now + WAIT, prefilled=shared * BS)
        expect, retry, wait = "queued", None, 0.0
        if prompt >= MML or prompt + m > MML or blocks > NB:
            expect = "kv_unservable"
        elif blocks <= NB - self.reserved() and len(self.running) < SEQS and not self.queue:
            expect = "granted"
        elif len(self.queue) >= QD:
            expect, retry = "queue_full", retry_after_seconds(max(0.0, self.starts(now, self.queue_work())[-1] - now))
        else:
            wait = max(0.0, self.starts(now, self.queue_work() + [(blocks, req.run_seconds)])[-1] - now)
            if wait > WAIT:
                expect, retry = "kv_timeout", retry_after_seconds(wait)
        try:
            kv = self.c._kv
            ticket = self.c.submit(prompt, max_tokens, request_id=kv.request(prompt, shared=shared))
        except AdmissionRejected as e:
            assert (e.reason, e.retry_after) == (expect, retry), (e.arithmetic, expect, retry)
            event(f"submit {expect}")
            return
        event(f"submit {expect}")
        assert ticket.state.value == expect, (ticket, expect)
        assert ticket.blocks_reserved == blocks and ticket.max_tokens == m
        req.id = ticket.id
        self.tickets[ticket.id] = ticket
        if expect == "granted":
            self.running[ticket.id] = req
            self.pending_grants.append(ticket.id)
        else:
            assert ticket.est_wait_at_arrival == wait
            self.queue.append(req)

    @rule(slow=st.sampled_from([0.0, 0.0, 0.0, 3.0, 25.0]))
    def engine_step(self, slow: float) -> None:
        """One engine step; `slow` extra seconds make it slower than the measured rate (so waits can expire)."""
        now = self.clock.t
        expired = []
        if self.queue and self.queue[0].deadline <= now:
            starts = self.starts(now, self.queue_work())
            while self.queue and self.queue[0].deadline <= now:
                expired.append((self.queue.pop(0).id, retry_after_seconds(max(0.0, starts.pop(0) - now))))
            self.pump()
        res = self.c.poll()
        if expired:
            event("poll expired")
        assert [(t.id, t.error.retry_after) for t in res.expired] == expired
        assert all(t.state is TicketState.EXPIRED and t.error.reason == "kv_timeout" for t in res.expired)
        assert [t.id for t in res.granted] == self.pending_grants
        assert [t.id for t in res.cancelled] == self.pending_cancels
        for rid in self.pending_grants:
            self.running[rid].seen = True
            self.engine.append(rid)
        self.pending_grants = []
        cancelled, self.pending_cancels = self.pending_cancels, []
        for rid in cancelled:
            self.engine.remove(rid)
            assert self.c.release(self.tickets[rid])
            self.end(rid)
        if not self.engine:
            return
        self.clock.advance(1.0 + slow)
        for rid in list(self.engine):
            r, t = self.running[rid], self.tickets[rid]
            r.generated += 1
            r.prefilled = r.prompt
            self.c._kv.allocate(t.request_id, -(-(r.prompt + r.generated) // BS) - r.shared)
            self.c.progress(t, tokens_generated=r.generated, prompt_prefilled=r.prompt)
            if r.generated == r.max_tokens:
                self.engine.remove(rid)
                assert self.c.release(t)
                self.end(rid)

    @precondition(lambda self: any(not self.running[i].cancel_requested for i in self.engine))
    @rule(data=st.data())
    def finish_early(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from([i for i in self.engine if not self.running[i].cancel_requested]))
        self.engine.remove(rid)
        assert self.c.release(self.tickets[rid])
        self.end(rid)

    @precondition(lambda self: bool(self.tickets))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tickets)))
        queued = [r.id for r in self.queue]
        if rid in queued:
            self.queue.pop(queued.index(rid))
            self.pump()
            expect = True
        elif rid in self.running and not self.running[rid].cancel_requested:
            r = self.running[rid]
            r.cancel_requested = True
            if r.seen:
                self.pending_cancels.append(rid)
            else:
                self.end(rid)
            expect = True
        else:
            expect = False
        assert self.c.cancel(self.tickets[rid]) is expect

    # ---------------------------------------------------------------- invariants

    @invariant()
    def matches_the_model(self) -> None:
        self.c.check_integrity()
        assert self.c.blocks_reserved == self.reserved() <= NB
        assert self.c.in_flight == len(self.running) <= SEQS
        assert [t.id for t in self.c._queue.values()] == [r.id for r in self.queue]
        assert sorted(self.c._running) == sorted(self.running)
        snap = self.c.snapshot()
        assert snap["blocks_available"] == NB - self.reserved() and snap["queue_depth"] == len(self.queue)

    def teardown(self) -> None:
        for t in list(self.tickets.values()):
            self.c.cancel(t)
        engine = FakeEngine(self.c, self.clock, kv=self.c._kv)
        engine.running = [self.tickets[i] for i in self.engine]
        engine.run_until_idle(max_steps=100)
        self.c.check_integrity()
        assert (self.c.blocks_reserved, self.c.in_flight, self.c.queue_depth) == (0, 0, 0)
        assert self.c.snapshot()["blocks_free"] == NB  # every allocated block was handed back
        assert all(t.state.ended for t in self.tickets.values())


TestAdmissionMachine = AdmissionMachine.TestCase
TestAdmissionMachine.settings = settings(max_examples=80, stateful_step_count=50, deadline=None)


@settings(max_examples=60, deadline=None)
@given(
    policy=st.sampled_from(["reserve", "backfill"]),
    arrivals=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 50), st.integers(1, 30)), min_size=1, max_size=25),
)
def test_the_head_starts_exactly_when_estimated_when_it_became_head(policy, arrivals) -> None:
    """With exact rates, a head starts when estimated at the moment it became head: backfill never delays it."""
    clock = FakeClock()
    c = controller(
        4,
        20,
        80,
        max_num_seqs=4,
        max_queue_depth=100,
        max_wait_secs=1e6,
        policy=policy,
        replan_interval_secs=0.0,
        clock=clock,
        rates=EngineRates(decode_step_seconds=1.0, prefill_token_seconds=0.0),
        debug=True,
    )
    engine = FakeEngine(c, clock)
    promised: dict[int, float] = {}
    tickets = []

    def observe() -> None:
        if not c.queue_depth:
            return
        head = next(iter(c._queue.values()))
        if head.id in promised:
            return
        now = clock.t
        # running as it was when `head` became head: without anything backfilled in that same instant
        running = [t for t in c._running.values() if not (t.backfilled and t.granted_at == now)]
        work = [SeqWork(t.blocks_reserved, 0, t.max_tokens - t.tokens_generated) for t in running]
        promised[head.id] = estimate_starts(
            now,
            c.rates,
            20 - sum(w.blocks for w in work),
            4 - len(work),
            work,
            [SeqWork(head.blocks_reserved, 0, head.max_tokens)],
        )[0]

    for gap, prompt, max_tokens in arrivals:
        for _ in range(gap):
            engine.step()
            observe()
        tickets.append(c.submit(prompt, max_tokens))
        observe()
    while c.in_flight or c.queue_depth:
        engine.step()
        observe()
    for t in tickets:
        if t.id in promised:
            assert t.granted_at == promised[t.id], (t, promised[t.id])
    assert c.blocks_reserved == 0
