"""The core channel's encoding: typed values cross as plain trees by their field names, frames as marshal bytes."""

from __future__ import annotations

import dataclasses
import enum
import socket
import threading
from dataclasses import dataclass, field

import pytest
import torch

from helexa.admission import AdmissionRejected, Ticket, TicketState
from helexa.config import EngineConfig
from helexa.engine import EngineClosed, RequestFailed, TokenEvent, TokenLogprob
from helexa.engine.core import engine_process_enabled
from helexa.engine.core.wire import (
    ChannelClosed,
    decode_error,
    encode_error,
    event_from_plain,
    event_to_plain,
    from_plain,
    read_frame,
    to_plain,
    write_frame,
)
from helexa.model.sampling import SamplingParams
from helexa.model.text.chat_template import ChatTemplateError
from helexa.model.weights.pull import DownloadError


class Tier(str, enum.Enum):
    POOL = "pool"
    DISK = "disk"


@dataclass(frozen=True)
class Stats:
    hits: int
    ratio: float
    tier: Tier


@dataclass
class Report:
    """Stands for a snapshot another issue grows: any plain field added here crosses with no code."""

    name: str
    stats: Stats
    per_tier: dict[str, Stats]
    history: list[tuple[int, float]]
    maybe: Stats | None = None
    ids: tuple[int, ...] = ()
    keyed: dict[int, float] = field(default_factory=dict)


def test_a_dataclass_tree_crosses_by_its_field_names() -> None:
    report = Report(
        "r", Stats(3, 0.5, Tier.DISK), {"a": Stats(1, 1.0, Tier.POOL)}, [(1, 2.5)], ids=(4, 5), keyed={7: -1.5}
    )
    plain = to_plain(report)
    assert plain["stats"] == {"hits": 3, "ratio": 0.5, "tier": "disk"}  # by name: no positional coupling
    assert from_plain(Report, plain) == report
    assert from_plain(Report, to_plain(dataclasses.replace(report, maybe=Stats(0, 0.0, Tier.POOL)))).maybe == Stats(
        0, 0.0, Tier.POOL
    )


def test_engine_values_cross_unchanged() -> None:
    config = EngineConfig.of(model="m", num_blocks=64, max_num_seqs=3, policy="adaptive")
    assert from_plain(EngineConfig, to_plain(config)) == config
    params = SamplingParams(max_tokens=9, temperature=0.7, seed=5, stop=["a", "b"], logit_bias={12: -100.0})
    assert from_plain(SamplingParams, to_plain(params)) == params
    ticket = Ticket(4, 10, 20, 2, "req-1", 1.0, 2.0, 0.0, state=TicketState.GRANTED, granted_at=1.5)
    back = from_plain(Ticket, to_plain(ticket))
    assert back.state is TicketState.GRANTED and back.waited_seconds == 0.5 and back.request_id == "req-1"
    event = TokenEvent(token_ids=(5,), text="x", logprobs=(TokenLogprob(5, -0.25, ((5, -0.25), (6, -2.0))),))
    assert from_plain(TokenEvent, to_plain(event)) == event


def test_a_field_of_the_wrong_plain_type_is_refused() -> None:
    """A scalar field takes exactly its type (or None) as it is; anything else goes through its checks."""
    plain = to_plain(TokenEvent(token_ids=(5,), text="x", finish_reason="stop", num_output_tokens=3))
    for name, wrong in (("text", 5), ("finish_reason", 1), ("num_output_tokens", "3"), ("num_prompt_tokens", 2.5)):
        with pytest.raises(TypeError):
            from_plain(TokenEvent, {**plain, name: wrong})
    assert from_plain(TokenEvent, {**plain, "finish_reason": None}).finish_reason is None
    assert from_plain(Stats, {"hits": 3, "ratio": 2, "tier": "pool"}).ratio == 2.0  # an int for a float: made one
    assert type(from_plain(Stats, {"hits": 3, "ratio": 2, "tier": "pool"}).ratio) is float


def test_errors_cross_as_their_own_class_with_their_fields() -> None:
    rejected = AdmissionRejected("queue_full", "full: 4 of 4 waiting", 7, {"queue_depth": 4})
    back = from_plain(TokenEvent, to_plain(TokenEvent(finish_reason="error", error=rejected))).error
    assert isinstance(back, AdmissionRejected)
    assert (back.reason, back.message, back.retry_after, back.arithmetic) == (
        "queue_full",
        str(rejected),
        7,
        {"queue_depth": 4},
    )
    for error in (RequestFailed("bad sampling"), EngineClosed("closing"), ValueError("no")):
        back = from_plain(TokenEvent, to_plain(TokenEvent(finish_reason="error", error=error))).error
        assert type(back) is type(error) and str(back) == str(error)


def test_an_unregistered_error_crosses_as_its_nearest_builtin_class() -> None:
    """A load error the server tells apart by kind (a bad template is a `ValueError`: exit 1 with one line)."""
    back = decode_error(encode_error(ChatTemplateError("the template fails")))
    assert type(back) is ValueError and str(back) == "ChatTemplateError: the template fails"
    back = decode_error(encode_error(DownloadError("no network")))  # registered: itself
    assert type(back) is DownloadError and str(back) == "no network"

    class Odd(BaseException):
        pass

    back = decode_error(encode_error(Odd("odd")))  # no builtin Exception above it: a RuntimeError
    assert type(back) is RuntimeError and str(back) == "Odd: odd"


def test_a_value_with_no_plain_form_is_refused() -> None:
    for value in (torch.zeros(2), threading.Lock(), lambda: 1, Report):
        with pytest.raises(TypeError, match="no plain form"):
            to_plain({"x": [value]})


def test_frames_round_trip_and_end_of_stream() -> None:
    a, b = socket.socketpair()
    with a, b:
        big = {"ids": list(range(100_000)), "text": "é" * 1000}
        sender = threading.Thread(target=lambda: [write_frame(a, ("events", [1, None])), write_frame(a, big)])
        sender.start()
        assert read_frame(b) == ("events", [1, None])
        assert read_frame(b) == big
        sender.join()
        a.close()
        with pytest.raises(ChannelClosed):
            read_frame(b)


def test_the_switch_reads_only_clear_values() -> None:
    assert engine_process_enabled("1") and engine_process_enabled("true") and engine_process_enabled(" on ")
    assert not engine_process_enabled("0") and not engine_process_enabled("off")
    assert engine_process_enabled("") and not engine_process_enabled("", default=False)  # unset: the default
    with pytest.raises(ValueError, match="HELEXA_ENGINE_PROCESS"):
        engine_process_enabled("2")


def test_a_token_event_crosses_compact_unless_it_has_logprobs_or_an_error() -> None:
    """A step's events cross in their compact form, a flat tuple of every field but logprobs and error (a field
    added to `TokenEvent` fails here until `compact` carries it); an event with logprobs or an error crosses in
    full. Either way the frame's events read back equal."""
    carried = {"token_ids", "text", "finish_reason", "num_prompt_tokens", "num_output_tokens", "num_cached_tokens"}
    assert {f.name for f in dataclasses.fields(TokenEvent)} == carried | {"logprobs", "error"}
    plain = TokenEvent(
        (7, 8), "é ", finish_reason="length", num_prompt_tokens=5, num_output_tokens=9, num_cached_tokens=3
    )
    compact = plain.compact()
    assert compact is not None and TokenEvent.from_compact(compact) == plain
    assert sorted(map(repr, compact)) == sorted(repr(getattr(plain, name)) for name in carried)
    with_logprobs = TokenEvent((7,), "x", logprobs=(TokenLogprob(7, -0.25, ((7, -0.25), (9, -2.0))),))
    with_error = TokenEvent(finish_reason="error", error=RequestFailed("sampling failed"))
    assert with_logprobs.compact() is None and with_error.compact() is None
    a, b = socket.socketpair()
    with a, b:
        events = [plain, with_logprobs, with_error]
        write_frame(a, ("events", [event_to_plain(e) for e in events]))
        _, got = read_frame(b)
    assert [type(g) for g in got] == [tuple, dict, dict]
    back = [event_from_plain(g) for g in got]
    assert back[:2] == events[:2]
    assert isinstance(back[2].error, RequestFailed) and str(back[2].error) == "sampling failed"
