"""The step scheduler: decodes first, chunked prefill under the token budget."""

from dataclasses import dataclass

from helexa.engine.scheduler import schedule


@dataclass
class FakeSeq:
    num_tokens: int
    num_computed: int


def test_decodes_before_prefills_and_budget_respected():
    decode_a, decode_b = FakeSeq(10, 9), FakeSeq(5, 4)
    long_prompt = FakeSeq(100, 0)
    chunks = schedule([long_prompt, decode_a, decode_b], max_num_batched_tokens=32)
    assert [(c.seq, c.num_new, c.samples) for c in chunks] == [
        (decode_a, 1, True),
        (decode_b, 1, True),
        (long_prompt, 30, False),
    ]


def test_prefill_finishing_this_step_samples():
    seq = FakeSeq(20, 12)
    (chunk,) = schedule([seq], max_num_batched_tokens=64)
    assert (chunk.num_new, chunk.samples) == (8, True)


def test_prefills_in_admission_order_and_idle_skipped():
    first, second, idle = FakeSeq(10, 0), FakeSeq(10, 0), FakeSeq(7, 7)
    chunks = schedule([first, idle, second], max_num_batched_tokens=15)
    assert [(c.seq, c.num_new, c.samples) for c in chunks] == [(first, 10, True), (second, 5, False)]
    assert sum(c.num_new for c in chunks) <= 15


def test_budget_exhausted_by_decodes():
    seqs = [FakeSeq(3, 2) for _ in range(5)] + [FakeSeq(50, 0)]
    chunks = schedule(seqs, max_num_batched_tokens=5)
    assert len(chunks) == 5 and all(c.num_new == 1 for c in chunks)
