"""Ending a stream from the stored result: gaps held back, the rest rebuilt with the same indexes and
text, reconnect waits bounded, and the publisher's bounded hold. Pure: no Redis, fake clock."""

from __future__ import annotations

import pytest

from producer.stream_ending import ending_events
from producer.streams import FIRST_RETRY_S, MAX_RETRY_S, Reconnect, StreamCursor
from protocol.errors import InputTooLong
from protocol.messages import Generation, GenerationTimings, InferenceResult, Timings, Usage
from protocol.streams import EVENT_FIELD, StreamEvent, encode_event
from workers.stream_buffer import PendingEvents

TEXTS = ["He", "ll", "", "o ", "wo", "rld", ""]  # token 2 completes no character; token 6 is EOS
IDS = [100 + i for i in range(len(TEXTS))]


def tok(i: int) -> StreamEvent:
    return StreamEvent(type="token", index=i, token_id=IDS[i], text=TEXTS[i])


def final(n: int) -> StreamEvent:
    usage = Usage(prompt_tokens=3, completion_tokens=n, total_tokens=3 + n)
    return StreamEvent(type="final", index=n, finish_reason="stop", usage=usage, text="!")


def stored(text: str = "Hello world!") -> InferenceResult:
    n = len(IDS)
    gen = Generation(
        token_ids=IDS, text=text, finish_reason="stop", usage=Usage(prompt_tokens=3, completion_tokens=n,
                                                                    total_tokens=3 + n),
        timings=GenerationTimings(time_to_first_token_ms=1, mean_inter_token_ms=1, decode_steps=n,
                                  batch_size_min=1, batch_size_mean=1, batch_size_max=1),
    )
    timings = Timings(queue_wait_ms=0, batch_wait_ms=0, inference_ms=1, batch_size=1, padded_tokens=3,
                      worker="w")
    return InferenceResult(request_id="r1", model="m", version="1", kind="generate", input_tokens=3, generation=gen,
                           timings=timings)


def entries(events: list[StreamEvent], first: int = 1) -> list[tuple[bytes, dict[bytes, bytes]]]:
    return [(f"{n}-0".encode(), {k.encode(): v.encode() for k, v in encode_event(e).items()})
            for n, e in enumerate(events, start=first)]


def summary(events: list[StreamEvent]) -> tuple[list[int], str, str]:
    """(token indexes, whole text, type of the last event)."""
    return [e.index for e in events if e.type == "token"], "".join(e.text for e in events), events[-1].type


@pytest.mark.parametrize("seen", [0, 1, 3, 6, 7])
def test_a_stream_cut_after_any_token_ends_from_the_result_like_the_whole_stream(seen: int) -> None:
    cursor = StreamCursor("r1", now_s=0.0, timeout_s=5.0)
    got = cursor.feed(entries([tok(i) for i in range(seen)]), now_s=0.0)
    got += cursor.finish_from(stored(), now_s=1.0)
    assert summary(got) == (list(range(7)), "Hello world!", "final") and cursor.finished
    assert [e.token_id for e in got if e.type == "token"] == IDS
    assert got[-1].usage is not None and got[-1].usage.completion_tokens == 7 and got[-1].finish_reason == "stop"


def test_a_gap_is_held_back_and_filled_from_the_result_without_a_duplicate() -> None:
    cursor = StreamCursor("r1", now_s=0.0, timeout_s=5.0, block_ms=500)
    written = [tok(0), tok(1), tok(4), tok(5), tok(6), final(7)]  # 2 and 3 were lost (a restart)
    got = cursor.feed(entries(written), now_s=0.0)
    assert [e.index for e in got] == [0, 1] and cursor.gap and not cursor.finished
    assert cursor.result_due(0.6, got_entries=True)  # a gap: look for the result without waiting for silence
    got += cursor.finish_from(stored(), now_s=0.6)
    assert summary(got) == (list(range(7)), "Hello world!", "final")
    assert cursor.feed(entries([tok(2), final(7)], first=9), now_s=0.7) == []  # late events: nothing twice


def test_a_final_after_missing_tokens_is_a_gap_not_the_end() -> None:
    cursor = StreamCursor("r1", now_s=0.0, timeout_s=5.0)
    assert [e.index for e in cursor.feed(entries([tok(0), final(7)]), now_s=0.0)] == [0]
    assert cursor.gap and not cursor.finished


def test_result_is_looked_for_on_silence_and_gaps_only() -> None:
    cursor = StreamCursor("r1", now_s=0.0, timeout_s=5.0, block_ms=1000)
    assert not cursor.result_due(0.1, got_entries=True)  # events flow: the stream is the source
    assert cursor.result_due(1.0, got_entries=False)  # a block ran out empty
    cursor.feed(entries([tok(0), tok(2)]), now_s=1.0)
    cursor.result_checked_s = 1.0
    assert not cursor.result_due(1.5, got_entries=True) and cursor.result_due(2.0, got_entries=True)


def test_a_stored_failure_ends_the_stream_with_its_error() -> None:
    cursor = StreamCursor("r1", now_s=0.0, timeout_s=5.0)
    cursor.feed(entries([tok(0)]), now_s=0.0)
    got = cursor.finish_from(InputTooLong("prompt too long", "input_ids", 64), now_s=0.0)
    assert [(e.type, e.error, e.field, e.limit) for e in got] == [("error", "InputTooLong", "input_ids", 64)]


def test_a_reader_ahead_of_a_shorter_stored_result_ends_with_its_final() -> None:
    """A first attempt streamed 7 tokens; the redelivered one stored fewer (its deadline): end, as the stream would."""
    short = stored("Hello")
    gen = short.generation
    assert gen is not None
    cut = short.model_copy(update={"generation": gen.model_copy(update={"token_ids": IDS[:4]})})
    got = ending_events("r1", cut, highest_index=6, shown_text="Hello world")
    assert [(e.type, e.index, e.text) for e in got] == [("final", 4, "")]


def test_text_that_is_not_the_results_prefix_is_an_error_not_a_guess() -> None:
    got = ending_events("r1", stored(), highest_index=1, shown_text="Jello")
    assert [e.type for e in got] == ["error"] and "r1" in (got[0].message or "")


def test_reconnect_backs_off_and_gives_up_after_the_bound() -> None:
    retry = Reconnect(max_outage_s=3.0)
    waits = [retry.failed(t) for t in (10.0, 10.05, 10.15, 10.35, 10.75, 11.55)]
    assert waits == [FIRST_RETRY_S, 0.1, 0.2, 0.4, 0.8, MAX_RETRY_S]
    assert retry.failed(12.9) == pytest.approx(0.1)  # never past the bound
    assert retry.failed(13.0) is None
    retry.answered()
    assert retry.failed(20.0) == FIRST_RETRY_S  # a new outage starts over


def _hold(hold: PendingEvents, request_id: str, event: StreamEvent, *, bounded: bool = True) -> bool:
    """Hold ``event`` as the publisher does (its JSON, and whether it ends the stream)."""
    return hold.add(request_id, encode_event(event)[EVENT_FIELD], last=event.is_last, bounded=bounded)


def test_the_hold_keeps_order_and_bounds_events_and_bytes() -> None:
    hold = PendingEvents(max_events=4, max_bytes=10_000)
    for i in range(6):
        _hold(hold, "a", tok(i))
    assert [h.event for h in hold.head(10)] == [encode_event(tok(i))[EVENT_FIELD] for i in range(4)]
    assert hold.dropped == 2
    assert not _hold(hold, "a", tok(6))  # its stream has a gap: later tokens are refused too
    assert _hold(hold, "a", final(7)) and _hold(hold, "b", final(0))  # the ends have a reserve
    assert len(hold) == 6 and hold.dropped == 3
    hold.pop(4)
    assert [h.last for h in hold.head(10)] == [True, True]
    assert _hold(hold, "c", tok(0))  # room again after the writes
    assert _hold(hold, "c", tok(1), bounded=False)  # Redis answers: all pass
    assert _hold(hold, "c", tok(2), bounded=False)
    assert len(hold) == 5
    small = PendingEvents(max_events=1000, max_bytes=300)
    added = sum(_hold(small, "d", tok(i)) for i in range(7))
    assert 0 < added < 7 and small.bytes <= 300 and small.dropped == 7 - added


def test_hold_refuses_nonsense_bounds() -> None:
    with pytest.raises(ValueError, match="max_events"):
        PendingEvents(max_events=0)
