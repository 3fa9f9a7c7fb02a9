"""StreamCursor: each token index once across redeliveries, the end always, silence measured on a fake clock."""

from __future__ import annotations

import pytest

from producer.streams import StreamCursor
from protocol.errors import DecodeError, ResultTimeout
from protocol.messages import Usage
from protocol.streams import StreamEvent, encode_event


def tok(i: int) -> StreamEvent:
    return StreamEvent(type="token", index=i, token_id=100 + i, text=f"t{i}")


def final(n: int, reason: str = "length") -> StreamEvent:
    usage = Usage(prompt_tokens=3, completion_tokens=n, total_tokens=3 + n)
    return StreamEvent(type="final", index=n, finish_reason=reason, usage=usage)  # type: ignore[arg-type]


def error() -> StreamEvent:
    return StreamEvent(type="error", index=0, error="expired", message="deadline passed")


def entries(events: list[StreamEvent], first: int = 1) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """Stream entries as redis-py returns them (bytes ids, bytes fields)."""
    out = []
    for n, event in enumerate(events, start=first):
        fields = {k.encode(): v.encode() for k, v in encode_event(event).items()}
        out.append((f"{n}-0".encode(), fields))
    return out


def indexes(events: list[StreamEvent]) -> list[tuple[str, int]]:
    return [(e.type, e.index) for e in events]


@pytest.mark.parametrize(
    ("written", "handed_on"),
    [
        ([tok(0), tok(1), final(2)], [("token", 0), ("token", 1), ("final", 2)]),
        # redelivered after two tokens: the replay of 0 and 1 is dropped, 2 onwards goes through
        ([tok(0), tok(1), tok(0), tok(1), tok(2), final(3)], [("token", 0), ("token", 1), ("token", 2), ("final", 3)]),
        # redelivered after the reader saw more than the second attempt wrote so far
        (
            [tok(0), tok(1), tok(2), tok(0), tok(1), tok(2), tok(3), final(4)],
            [("token", 0), ("token", 1), ("token", 2), ("token", 3), ("final", 4)],
        ),
        # the end is handed on even below the highest index (a redelivered attempt that hit its deadline)
        (
            [tok(0), tok(1), tok(2), tok(0), final(1, "deadline")],
            [("token", 0), ("token", 1), ("token", 2), ("final", 1)],
        ),
        ([error()], [("error", 0)]),
        ([tok(0), error()], [("token", 0), ("error", 0)]),
        # nothing after the end
        ([tok(0), final(1), tok(0), final(1)], [("token", 0), ("final", 1)]),
    ],
)
def test_each_index_once_and_the_end_always(written: list[StreamEvent], handed_on: list[tuple[str, int]]) -> None:
    cursor = StreamCursor("r1", now_s=0.0, timeout_s=5.0)
    assert indexes(cursor.feed(entries(written), now_s=0.0)) == handed_on
    assert cursor.finished is (handed_on[-1][0] != "token")


def test_same_result_entry_by_entry() -> None:
    written = [tok(0), tok(1), tok(0), tok(1), tok(2), final(3)]
    cursor = StreamCursor("r1", now_s=0.0, timeout_s=5.0)
    seen: list[StreamEvent] = []
    for n, entry in enumerate(entries(written), start=1):
        seen += cursor.feed([entry], now_s=float(n))
        assert cursor.last_id == f"{n}-0".encode()
    assert indexes(seen) == [("token", 0), ("token", 1), ("token", 2), ("final", 3)]


@pytest.mark.parametrize(
    ("now_s", "block_ms", "expected_ms", "timed_out"),
    [
        (0.0, 1000, 1000, False),  # plenty of time left: one full block
        (9.5, 1000, 500, False),  # the block never outlasts the silence allowed
        (9.9999, 1000, 1, False),  # never 0: XREAD BLOCK 0 waits forever
        (10.0, 1000, 1, True),
        (12.0, 250, 1, True),
        (3.0, 250, 250, False),
    ],
)
def test_block_never_outlasts_the_timeout(now_s: float, block_ms: int, expected_ms: int, timed_out: bool) -> None:
    cursor = StreamCursor("r1", now_s=0.0, timeout_s=10.0, block_ms=block_ms)
    assert cursor.block_for_ms(now_s) == expected_ms
    assert cursor.timed_out(now_s) is timed_out


def test_any_entry_restarts_the_silence_a_replay_too() -> None:
    cursor = StreamCursor("r1", now_s=0.0, timeout_s=10.0)
    cursor.feed(entries([tok(0)]), now_s=8.0)
    assert not cursor.timed_out(17.0)
    assert cursor.feed(entries([tok(0)], first=2), now_s=17.0) == []  # a replayed token: dropped, yet alive
    assert not cursor.timed_out(26.0) and cursor.timed_out(27.0)
    assert cursor.feed([], now_s=27.0) == [] and cursor.timed_out(27.0)  # an empty read restarts nothing
    with pytest.raises(ResultTimeout):
        cursor.read(None, now_s=27.0)  # what XREAD BLOCK returns when its block ran out


def test_read_takes_both_reply_shapes() -> None:
    resp2 = [[b"fleet:stream:r1", entries([tok(0), tok(1)])]]
    resp3 = {b"fleet:stream:r1": [entries([tok(2), final(3)], first=3)]}
    cursor = StreamCursor("r1", now_s=0.0, timeout_s=1.0, block_ms=200)
    assert cursor.xread_args(0.0) == ({"fleet:stream:r1": "0-0"}, 256, 200)
    assert indexes(cursor.read(resp2, 0.5)) == [("token", 0), ("token", 1)]
    assert cursor.xread_args(0.5) == ({"fleet:stream:r1": b"2-0"}, 256, 200)
    assert indexes(cursor.read(resp3, 0.6)) == [("token", 2), ("final", 3)] and cursor.finished
    unified = {b"fleet:stream:r2": entries([tok(0)])}
    assert indexes(StreamCursor("r2", now_s=0.0, timeout_s=1.0).read(unified, 0.0)) == [("token", 0)]


def test_timeout_error_names_the_limit() -> None:
    cursor = StreamCursor("r1", now_s=0.0, timeout_s=2.5)
    err = cursor.timeout_error()
    assert isinstance(err, ResultTimeout) and err.field == "timeout_s" and err.limit == 2.5
    assert "r1" in err.message and "no event in" in err.message
    cursor.feed(entries([tok(0), tok(1)]), now_s=0.0)
    assert "after token 1" in cursor.timeout_error().message


def test_bad_entry_raises_decode_error() -> None:
    cursor = StreamCursor("r1", now_s=0.0, timeout_s=1.0)
    with pytest.raises(DecodeError):
        cursor.feed([(b"1-0", {b"e": b"not json"})], now_s=0.0)
    with pytest.raises(DecodeError):
        cursor.feed([(b"2-0", {b"x": b"{}"})], now_s=0.0)


@pytest.mark.parametrize(("timeout_s", "block_ms"), [(0.0, 1000), (-1.0, 1000), (1.0, 0)])
def test_bad_arguments(timeout_s: float, block_ms: int) -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        StreamCursor("r1", now_s=0.0, timeout_s=timeout_s, block_ms=block_ms)
