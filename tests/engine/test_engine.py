"""The engine end to end on a tiny model: batch invariance, chunked prefill, streams, aborts, no leaks."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from helexa.admission import AdmissionRejected
from helexa.engine.interface import EngineClosed
from helexa.model.sampling import SamplingParams
from tests.support.engines import assert_released, drive, make_engine, random_prompts, tokens
from tests.support.loops import CountingLoop

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def solo_outputs(tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=512)
    out = []
    for prompt in random_prompts(6):
        (h,) = [engine.submit(prompt, GREEDY)]
        out.append(tokens(drive(engine, [h])[h.request_id]))
    assert_released(engine)
    return out


@pytest.mark.parametrize("max_batched", [8, 23, 512])
def test_greedy_is_batch_invariant_with_and_without_chunked_prefill(tiny_model_dir, solo_outputs, max_batched):
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=max_batched)
    handles = [engine.submit(p, GREEDY) for p in random_prompts(6)]
    events = drive(engine, handles)
    assert [tokens(events[h.request_id]) for h in handles] == solo_outputs
    assert all(events[h.request_id][-1].finish_reason == "length" for h in handles)
    assert_released(engine)


def test_text_deltas_match_full_decode_and_usage(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    h = engine.submit(
        engine.tokenizer.encode("hello world"), SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    )
    events = drive(engine, [h])[h.request_id]
    ids = tokens(events)
    assert "".join(e.text for e in events) == engine.tokenizer.decode(ids)
    assert events[-1].num_output_tokens == 20 and events[-1].num_prompt_tokens == h.prompt_tokens


def test_stop_string_is_trimmed(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    prompt = engine.tokenizer.encode("the quick brown fox")
    free = drive(engine, [h := engine.submit(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))])[
        h.request_id
    ]
    text = "".join(e.text for e in free)
    if len(text) < 6:
        pytest.skip("the tiny model produced too little text to pick a stop string")
    stop = text[3:6]
    h2 = engine.submit(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop]))
    stopped = drive(engine, [h2])[h2.request_id]
    assert "".join(e.text for e in stopped) == text[: text.index(stop)]
    assert stopped[-1].finish_reason == "stop"
    assert_released(engine)


def test_seeded_sampling_reproducible_across_batches(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=1234, ignore_eos=True)
    prompt = random_prompts(1, seed=5)[0]
    alone = tokens(drive(engine, [h := engine.submit(prompt, params)])[h.request_id])
    others = [engine.submit(p, SamplingParams(max_tokens=7, temperature=0.8)) for p in random_prompts(3, seed=9)]
    mine = engine.submit(prompt, params)
    batched = drive(engine, others + [mine])
    assert tokens(batched[mine.request_id]) == alone


def test_queued_request_waits_for_blocks_then_runs(tiny_model_dir):
    # 16 blocks of 8 tokens; each request needs ceil((40+40)/8) = 10 blocks: the second must queue.
    engine = make_engine(tiny_model_dir, num_blocks=16)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    first = engine.submit(list(range(3, 43)), params)
    second = engine.submit(list(range(5, 45)), params)
    assert engine.snapshot()["queue_depth"] == 1
    events = drive(engine, [first, second])
    assert events[second.request_id][-1].finish_reason == "length"
    assert len(tokens(events[second.request_id])) == 40
    assert_released(engine)


def test_unservable_rejected_at_once(tiny_model_dir):
    engine = make_engine(tiny_model_dir, num_blocks=16)
    with pytest.raises(AdmissionRejected) as info:
        engine.submit(list(range(3, 100)), SamplingParams(max_tokens=100))
    assert info.value.reason == "kv_unservable" and info.value.retry_after is None
    assert_released(engine)


def test_bad_prompts_are_value_errors(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    with pytest.raises(ValueError, match="empty"):
        engine.submit([], GREEDY)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.submit([3, 100000], GREEDY)
    assert_released(engine)


def test_abort_queued_and_running_release_everything(tiny_model_dir):
    engine = make_engine(tiny_model_dir, num_blocks=16)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    running = engine.submit(list(range(3, 43)), params)
    queued = engine.submit(list(range(5, 45)), params)
    engine.step()
    engine.step()
    engine.abort(queued.request_id)
    engine.abort(running.request_id)
    engine.abort(running.request_id)  # idempotent
    events = drive(engine, [running, queued])
    assert events[queued.request_id][-1].finish_reason == "abort"
    assert events[running.request_id][-1].finish_reason == "abort"
    assert_released(engine)


def test_threaded_loop_serves_concurrent_submitters_and_shuts_down(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    engine.start()
    results: dict[int, list[int]] = {}

    def client(i: int) -> None:
        h = engine.submit(random_prompts(1, seed=i)[0], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        results[i] = tokens(list(h.stream))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(results) == list(range(6)) and all(len(v) == 8 for v in results.values())
    engine.shutdown(grace_seconds=1.0)
    with pytest.raises(EngineClosed):
        engine.submit([3, 4], GREEDY)
    assert_released(engine)
    engine.check_integrity()


def test_shutdown_aborts_what_does_not_finish_in_grace(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    engine.start()
    h = engine.submit([3, 4, 5], SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
    time.sleep(0.05)
    engine.shutdown(grace_seconds=0.0)
    events = list(h.stream)
    assert events[-1].finish_reason == "abort"
    assert_released(engine)


@pytest.mark.parametrize("speculative", ["off", "ngram"])
def test_a_step_wakes_its_consumers_loop_once(tiny_model_dir, speculative):
    """Four requests consumed on one event loop (as the server and the core process consume them): a step
    wakes that loop once, not once per event (several a request with drafts); every token still arrives,
    and the same tokens as consumed from threads."""
    counting = CountingLoop()
    try:
        engine = make_engine(tiny_model_dir, speculative=speculative)
        prompts = [[5, 6, 7, 8] * 4 + [9 + i] for i in range(4)]  # repeats: drafts find something to copy
        handles = [engine.submit(p, GREEDY) for p in prompts]
        got: dict[str, list[int]] = {h.request_id: [] for h in handles}

        async def consume(handle) -> None:
            async for event in handle.stream:
                got[handle.request_id].extend(event.token_ids)

        for handle in handles:
            counting.bind(handle.stream)
        futures = [asyncio.run_coroutine_threadsafe(consume(h), counting.loop) for h in handles]
        steps, wakes = 0, []
        while not all(f.done() for f in futures) and steps < 200:
            before = counting.calls
            engine.step()
            steps += 1
            wakes.append(counting.calls - before)
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0), counting.loop).result(5)  # it has run
        for future in futures:
            future.result(5)
        # one wake-up a step, and one per request for its final event, put after the step's blocks are offered
        assert max(wakes) <= 1 + len(handles) and sum(wakes) <= steps + len(handles)
        assert sum(1 for w in wakes if w > 1) <= len(handles)
        reference = make_engine(tiny_model_dir, speculative=speculative)
        expected = drive(reference, [reference.submit(p, GREEDY) for p in prompts])
        assert [got[h.request_id] for h in handles] == [tokens(e) for e in expected.values()]
        assert_released(engine)
    finally:
        counting.close()
