"""Prefill chunks sized to a step time (`--target-step-secs`): the budget, its cost model, and the engine with it.

Every test runs on fake step costs (a fixed cost model, or a simulated device clock), never on real timing.
"""

from __future__ import annotations

import argparse
import random
import statistics
from dataclasses import dataclass, field

import pytest
import torch

from helexa.admission.rates import RateTracker
from helexa.config import EngineConfig, add_flags, from_flags
from helexa.engine.engine import _target_step_secs
from helexa.engine.scheduler import schedule
from helexa.engine.step_budget import MeasuredStepCost, StepBudget, StepEstimate
from helexa.model.sampling import SamplingParams
from tests.support.engines import assert_released, drive, make_engine, run_streams, tokens


@dataclass
class FixedCost:
    """A step that decodes costs `decode` seconds plus `per_token` per prompt token (a full chunk `full_rate` per
    token, `per_token` when not given); learns nothing."""

    decode: float
    per_token: float
    full_rate: float | None = None
    observed: list[tuple[int, int]] = field(default_factory=list)

    def estimate(self) -> StepEstimate:
        return StepEstimate(self.decode, self.per_token, self.full_rate or self.per_token)

    def observe(
        self, seconds: float, num_decode: int, num_prefill: int, decode_yield: float = 1.0, draft_rows: int = 0
    ) -> None:
        assert seconds > 0 and decode_yield >= 1 and 0 <= draft_rows <= num_decode
        self.observed.append((num_decode, num_prefill))

    def seconds(self, num_decode: int, num_prefill: int) -> float:
        return (self.decode if num_decode else 0.0) + num_prefill * self.per_token


@dataclass
class FakeSeq:
    num_tokens: int
    num_computed: int


# ---------------------------------------------------------------------------------------------- the budget


def test_slow_steps_shrink_prefill_chunks_to_the_target():
    cost = FixedCost(decode=0.1, per_token=0.01)
    budget = StepBudget(2048, 0.5, 16, cost)
    limit = budget.prefill_limit(1)
    assert limit == 40 and cost.seconds(1, limit) <= 0.5 < cost.seconds(1, limit + 1)
    assert budget.chunk_tokens == 40
    assert budget.prefill_limit(0) == 2048  # nothing decodes: no stream waits on the step


def test_fast_steps_keep_the_full_budget():
    budget = StepBudget(2048, 0.5, 16, FixedCost(decode=0.01, per_token=1e-5))
    assert budget.prefill_limit(1) == budget.prefill_limit(64) == budget.chunk_tokens == 2048


def test_tier_loads_are_sized_like_prefill_chunks():
    budget = StepBudget(2048, 0.5, 16, FixedCost(decode=0.1, per_token=0.01))
    assert budget.load_limit(1, 0.004) == 100  # the 0.4 s the decodes leave, at 4 ms a block
    assert budget.load_limit(1, None) == 40 // 16  # before a read was measured: a prefill chunk's tokens
    assert budget.load_limit(1, 1.0) == 1  # at least one block a step
    slow = StepBudget(2048, 0.5, 16, FixedCost(decode=0.6, per_token=0.01))
    assert slow.load_limit(1, 0.004) == 150  # decodes alone miss the target: loads get as long as they take
    assert budget.load_limit(0, 0.004) == StepBudget(2048, 0.0, 16, FixedCost(0.1, 0.01)).load_limit(3, 0.004)
    assert budget.load_limit(0, 0.004) >= 2**62  # nothing decodes, or no target: no stream waits on the loads


def test_zero_target_is_the_fixed_budget():
    budget = StepBudget(512, 0.0, 16, FixedCost(decode=1.0, per_token=1.0))
    assert not budget.enabled and budget.prefill_limit(3) == budget.chunk_tokens == 512
    with pytest.raises(ValueError):
        StepBudget(512, -1.0, 16, FixedCost(0.1, 0.1))


def test_prefill_keeps_a_block_and_half_of_each_step():
    # Decoding alone takes longer than the target: prefill still gets as much time as the decodes (at the rate
    # of a full chunk, whatever small chunks cost on top)...
    assert StepBudget(2048, 0.5, 16, FixedCost(decode=0.6, per_token=0.01)).prefill_limit(1) == 60
    assert StepBudget(2048, 0.5, 16, FixedCost(decode=0.6, per_token=0.05, full_rate=0.01)).prefill_limit(1) == 60
    # ...and never less than one block.
    assert StepBudget(2048, 0.5, 16, FixedCost(decode=0.6, per_token=1.0)).prefill_limit(1) == 16
    assert StepBudget(8, 0.5, 16, FixedCost(decode=0.6, per_token=1.0)).prefill_limit(1) == 8  # capped by the budget


def test_scheduler_applies_the_limit_after_decodes():
    decodes = [FakeSeq(10, 9), FakeSeq(5, 4)]
    first, second = FakeSeq(100, 0), FakeSeq(30, 0)
    seen: list[int] = []

    def limit(num_decode: int) -> int:
        seen.append(num_decode)
        return 25

    chunks = schedule([first, *decodes, second], 64, limit)
    assert seen == [2]
    assert [(c.seq, c.num_new, c.samples) for c in chunks] == [
        (decodes[0], 1, True),
        (decodes[1], 1, True),
        (first, 25, False),
    ]
    # The limit never takes tokens from decodes, and the step budget still caps everything.
    seqs = [FakeSeq(3, 2) for _ in range(5)] + [FakeSeq(50, 0)]
    chunks = schedule(seqs, 6, lambda n: 100)
    assert [c.num_new for c in chunks] == [1] * 5 + [1]
    assert [c.num_new for c in schedule(decodes, 64, lambda n: 0)] == [1, 1]  # no prefill: not asked


# ------------------------------------------------------------------------------ the measured cost, simulated


def _device(num_decode: int, num_prefill: int, context: int) -> float:
    """A simulated CPU: a decode step 0.1 s; a chunk 50 ms more, plus 6 ms a prompt token, which attention makes
    twice that at a context of 2,000."""
    chunk = (0.05 + num_prefill * 0.006 * (1 + (context + num_prefill / 2) / 2000)) if num_prefill else 0.0
    return (0.1 if num_decode else 0.02) + chunk


def _simulate(
    target: float, calibration_error: float = 1.0, stalls=(), prompt: int = 2000, slow_until_prompt: float = 1.0
) -> list[float]:
    """One stream decoding while a `prompt`-token request prefills: the seconds of each step it waits on.

    `slow_until_prompt`: the device runs that many times slower at calibration and until the prompt arrives.
    """
    slow = slow_until_prompt
    rates = RateTracker.calibrated(_device(8, 0, 0) * slow, _device(0, 256, 0) * slow / 256 * calibration_error)
    budget = StepBudget(2048, target, 16, MeasuredStepCost(rates))

    def run(num_decode: int, num_prefill: int, context: int, stall: bool = False, early: bool = False) -> float:
        seconds = _device(num_decode, num_prefill, context) * (20 if stall else 1) * (slow if early else 1)
        budget.observe(seconds, num_decode, num_prefill)  # as `Engine._record` does, after every step (rates too)
        return seconds

    for _ in range(5):
        run(1, 0, 0, early=True)
    steps, done = [], 0
    while done < prompt:
        n = min(prompt - done, budget.prefill_limit(1))
        steps.append(run(1, n, done, stall=len(steps) in stalls))
        done += n
    return steps


def test_measured_cost_holds_steps_at_the_target_as_attention_grows():
    steps = _simulate(0.5)
    assert max(steps) <= 0.5 * 1.05 and statistics.median(steps) >= 0.48  # every step near 0.5 s, none far over
    alone = _device(0, 2000, 0)  # the fixed budget: the whole prompt in one step the stream waits on, 18 s
    assert alone > 15 and sum(steps) < 2 * alone  # the prompt's own prefill takes under twice as long


def test_measured_cost_recovers_from_a_bad_calibration():
    slow = _simulate(0.5, calibration_error=3)  # calibrated 3x too slow: the first chunk is small, then on target
    assert max(slow) <= 0.5 * 1.05 and statistics.median(slow) >= 0.48
    fast = _simulate(0.5, calibration_error=1 / 3)  # 3x too fast: the first chunk overshoots, the next are on target
    assert fast[0] > 0.5 and max(fast[1:]) <= 0.5 * 1.4 and statistics.median(fast) <= 0.6
    # (the measured steps correct the chunks; but late in the prompt the floor, which believes full chunks 3x
    # cheaper than they are, holds 45 tokens: up to 0.69 s, until a big prefill measures them)


def test_a_stalled_step_does_not_move_the_chunks():
    steady, stalled = _simulate(0.5), _simulate(0.5, stalls=(5, 20))
    assert max(stalled) > 5  # the stalls themselves (20x a step)
    assert max(s for i, s in enumerate(stalled) if i not in (5, 20)) <= 0.5 * 1.05
    assert len(stalled) == len(steady)


def test_a_device_that_speeds_up_mid_prefill_is_caught_up_with():
    # Measured 4x slower at load and before the prompt (a CPU shared with other processes until then): the chunks
    # are first sized to stale costs; a probe re-measures the decodes alone, and the steps return to the target.
    steps = _simulate(0.5, slow_until_prompt=4.0)
    probe = 16  # after 16 steps that decoded and prefilled, one that only decodes: 0.1 s
    assert steps[probe] == pytest.approx(0.1) and steps[probe - 1] > 0.5  # the floor sized to the stale decodes
    assert max(steps) <= 0.7 and max(steps[probe + 3 :]) <= 0.5 * 1.1 and statistics.median(steps) >= 0.45


def test_a_long_prefill_is_probed_with_a_decode_only_step():
    budget = StepBudget(2048, 0.5, 16, FixedCost(decode=0.1, per_token=0.01), probe_every=3)
    limits = []
    for _ in range(8):
        limits.append(budget.prefill_limit(2))
        budget.observe(0.5, 2, limits[-1])
    assert limits == [40, 40, 40, 0, 40, 40, 40, 0]
    assert budget.prefill_limit(0) == 2048  # nothing decodes: never probed


def test_where_decoding_alone_misses_the_target_prefill_keeps_half_of_each_step():
    rates = RateTracker.calibrated(0.8, 0.01)
    cost = MeasuredStepCost(rates)
    budget = StepBudget(2048, 0.5, 16, cost)
    for _ in range(3):  # decode-only steps measure the decodes alone (admission's medians learn from them too)
        cost.observe(0.8, 1, 0)
    assert budget.prefill_limit(1) == 80  # 0.8 s of decodes: a full chunk's tokens in 0.8 s
    for _ in range(3):
        cost.observe(2.4, 1, 80)  # 80-token chunks add 20 ms a token, twice a full chunk's: the floor stays
    assert budget.prefill_limit(1) == 80
    for _ in range(2):
        cost.observe(1.2, 1, 80)  # they add 5 ms a token: full chunks cannot cost more, so the floor doubles
    assert budget.prefill_limit(1) == 160


def test_measured_cost_learns_each_kind_of_step():
    rates = RateTracker.calibrated(0.2, 0.01)
    cost = MeasuredStepCost(rates)
    assert cost.estimate() == StepEstimate(0.2, 0.01, 0.01)  # the calibrated rates, before any step
    for seconds in (0.1, 0.1, 5.0):
        cost.observe(seconds, 3, 0)  # decode-only steps: their median
    cost.observe(3.0, 0, 512)  # a big prefill without decodes: its cost per token
    cost.observe(9.0, 0, 64)  # a small one says little about full chunks: ignored
    for seconds in (0.5, 0.6, 60.0):
        cost.observe(seconds, 2, 40)  # mixed steps: what their chunks added per token (median of the last 3)
    assert cost.estimate() == pytest.approx(StepEstimate(0.1, 0.0125, 3.0 / 512))


def test_steps_that_verify_drafts_measure_the_row_cost_not_the_decode_step():
    """A step that verified draft rows costs more than decoding alone: it is not a decode step's sample,
    and what each of its draft rows added is the row cost the drafter weighs drafts with (before any such
    step, a prompt token's cost stands in). At long context that row attends over the whole context and
    costs far more than a prompt token of a chunk."""
    cost = MeasuredStepCost(RateTracker.calibrated(0.2, 0.01))
    for _ in range(3):
        cost.observe(0.03, 1, 0)  # one stream decoding alone: 30 ms
    cost.observe(0.5, 0, 512)  # a big prefill: ~1 ms a token
    assert cost.estimate().verify_row is None and cost.estimate().row_seconds == pytest.approx(0.5 / 512)
    for seconds, rows in ((0.07, 4), (0.06, 3), (0.09, 6)):  # draft rows add 10 ms each
        cost.observe(seconds, 1 + rows, 0, draft_rows=rows)
    est = cost.estimate()
    assert est.decode_seconds == pytest.approx(0.03)  # the verify steps are not decode steps' samples
    assert est.verify_row == pytest.approx(0.01) and est.row_seconds == pytest.approx(0.01)
    cost.observe(0.0300001, 5, 0, draft_rows=4)  # a draft row is never taken as free: at least full_rate / 4
    cost.observe(0.0300001, 5, 0, draft_rows=4)
    assert cost.estimate().verify_row == pytest.approx(0.5 / 512 / 4)


# -------------------------------------------------------------------------------------------- the engine


LONG = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
STREAM = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def _prompts() -> tuple[list[int], list[int]]:
    rng = random.Random(7)
    return [rng.randrange(3, 400) for _ in range(12)], [rng.randrange(3, 400) for _ in range(400)]


@pytest.fixture(scope="module")
def unchunked(tiny_model_dir):
    """Each request alone, its prompt in one step (no target): the outputs every other run must equal."""
    engine = make_engine(tiny_model_dir, num_blocks=128, max_num_batched_tokens=512, target_step_secs=0.0)
    assert engine.step_budget.chunk_tokens == 512
    out = []
    for prompt, params in zip(_prompts(), (STREAM, LONG)):
        h = engine.submit(prompt, params)
        out.append(tokens(drive(engine, [h])[h.request_id]))
    assert_released(engine)
    return out


@pytest.mark.parametrize("per_token, chunk", [(0.005, 40), (0.0054, 37)])  # 37: chunks end mid-block
def test_decoding_stream_interleaves_with_a_long_prefill(tiny_model_dir, unchunked, per_token, chunk):
    engine = make_engine(tiny_model_dir, num_blocks=128, max_num_batched_tokens=512, target_step_secs=0.25)
    cost = FixedCost(decode=0.05, per_token=per_token)  # a slow device: `chunk` prompt tokens fit a 0.25 s step
    engine.step_budget.cost = cost
    assert engine.snapshot()["prefill_chunk_tokens"] == chunk and engine.snapshot()["target_step_secs"] == 0.25
    short, long = _prompts()
    stream = engine.submit(short, STREAM)
    engine.step()  # its prompt, alone: one step
    first = stream.stream.get(timeout=0)
    assert first.token_ids
    prefill = engine.submit(long, LONG)
    steps: list[tuple[int, int]] = []  # after each step: (prompt tokens computed of the long request, stream tokens)

    def record(engine) -> None:
        running = {s.request_id: s for s in engine._running}
        seq, decoder = running.get(prefill.request_id), running.get(stream.request_id)
        steps.append((min(seq.num_computed, len(long)) if seq else len(long), decoder.num_output if decoder else -1))

    events = run_streams(engine, [stream, prefill], after_step=record)
    computed = [0] + [c for c, _ in steps]
    chunks = [b - a for a, b in zip(computed, computed[1:]) if b > a]
    steps_needed = -(-len(long) // chunk)
    assert chunks == [chunk] * (len(long) // chunk) + [len(long) % chunk] * (len(long) % chunk > 0)
    assert len(chunks) == steps_needed  # 400 prompt tokens in 10 or 11 steps (the fixed budget: one step of 400)
    # The stream gains a token in every one of those steps: the prefill never stalls it.
    assert [o for _, o in steps[:steps_needed]] == list(range(2, 2 + steps_needed))
    assert all(cost.seconds(1, n) <= 0.25 for n in chunks)  # each of those steps within the target
    outputs = [tokens([first, *events[stream.request_id]]), tokens(events[prefill.request_id])]
    assert outputs == unchunked  # chunking changes no output
    assert (1, chunk) in cost.observed and (1, 0) in cost.observed  # every step's cadence reached the cost model
    assert_released(engine)


def test_a_prompt_with_nothing_decoding_keeps_the_full_budget(tiny_model_dir, unchunked):
    engine = make_engine(tiny_model_dir, num_blocks=128, max_num_batched_tokens=512, target_step_secs=0.25)
    engine.step_budget.cost = FixedCost(decode=0.05, per_token=0.005)
    _, long = _prompts()
    h = engine.submit(long, LONG)
    engine.step()
    first = h.stream.get(timeout=0)
    assert first.token_ids  # the whole prompt in one step: no stream was waiting on it
    assert tokens([first, *drive(engine, [h])[h.request_id]]) == unchunked[1]


def test_measured_chunks_on_real_timing_change_no_output(tiny_model_dir, unchunked):
    # A target no step can meet: chunks fall to the floor the measured costs give (whatever this machine's
    # timing); what each request generates stays that of the unchunked run.
    engine = make_engine(tiny_model_dir, num_blocks=128, max_num_batched_tokens=512, target_step_secs=1e-6)
    short, long = _prompts()
    stream = engine.submit(short, STREAM)
    engine.step()
    first = stream.stream.get(timeout=0)
    prefill = engine.submit(long, LONG)
    events = run_streams(engine, [stream, prefill])
    assert [tokens([first, *events[stream.request_id]]), tokens(events[prefill.request_id])] == unchunked
    assert 8 <= engine.step_budget.chunk_tokens <= 512
    assert_released(engine)


def test_target_defaults_by_device_and_validates():
    assert _target_step_secs(EngineConfig(), torch.device("cpu")) == 0.5
    assert _target_step_secs(EngineConfig(), torch.device("cuda")) == 0.0
    assert _target_step_secs(EngineConfig.of(target_step_secs=0.0), torch.device("cpu")) == 0.0
    assert _target_step_secs(EngineConfig.of(target_step_secs=2), torch.device("cuda")) == 2.0
    for bad in (-0.5, float("nan"), "fast", True):
        with pytest.raises(ValueError, match="target_step_secs"):
            EngineConfig.of(target_step_secs=bad)
    parser = argparse.ArgumentParser()
    add_flags(parser, EngineConfig)
    assert from_flags(EngineConfig, parser.parse_args([])).target_step_secs is None
    assert from_flags(EngineConfig, parser.parse_args(["--target-step-secs", "0.25"])).target_step_secs == 0.25


def test_engine_on_cpu_sizes_chunks_by_default(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    assert engine.target_step_secs == 0.5 and engine.step_budget.enabled
    snap = engine.snapshot()
    assert snap["target_step_secs"] == 0.5 and 16 <= snap["prefill_chunk_tokens"] <= 64
