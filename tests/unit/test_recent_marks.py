"""workers.recent_marks.RecentMarks: bounded by forgetting the oldest mark, never every mark at once; the stream
hold's cut streams use it."""

from __future__ import annotations

import pytest

from workers import stream_buffer
from workers.recent_marks import RecentMarks


def test_past_the_limit_only_the_oldest_mark_is_forgotten() -> None:
    marks: RecentMarks[float] = RecentMarks(3)
    for i, key in enumerate("abcd"):
        marks.mark(key, float(i))
    assert [k for k in "abcd" if k in marks] == ["b", "c", "d"] and marks.forgotten == 1
    marks.mark("b", 9.0)  # set again: newest, so c is the oldest now
    marks.mark("e", 4.0)
    assert [k for k in "bcde" if k in marks] == ["b", "d", "e"] and marks.get("b", -1.0) == 9.0
    assert marks.get("c", -1.0) == -1.0 and len(marks) == 3 and marks.forgotten == 2


def test_a_discarded_mark_frees_its_room() -> None:
    marks: RecentMarks[None] = RecentMarks(2)
    marks.mark("a", None)
    marks.mark("b", None)
    marks.discard("a")
    marks.discard("gone")  # no mark: nothing happens
    marks.mark("c", None)
    assert "b" in marks and "c" in marks and marks.forgotten == 0


@pytest.mark.parametrize("limit", [0, -1])
def test_a_limit_below_one_is_refused_naming_it(limit: int) -> None:
    with pytest.raises(ValueError, match=r"limit \(-?\d+\) must be >= 1"):
        RecentMarks(limit)



def test_the_holds_cut_streams_are_bounded_by_forgetting_the_oldest(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream cut over the hold's bound stays cut until its end; past ``MAX_CUT_STREAMS`` cut streams the one
    cut longest ago is forgotten (its tokens are held again; its reader, past the gap, finishes from the stored
    result). Before, the set of cut streams had no bound at all (new bound, not a failing behaviour)."""
    monkeypatch.setattr(stream_buffer, "MAX_CUT_STREAMS", 2)
    hold = stream_buffer.PendingEvents(max_events=1)
    assert hold.add("held", "t0", last=False)
    for rid in ("a", "b", "c"):  # over the bound: each refused and cut; a is forgotten when c is cut
        assert not hold.add(rid, "t0", last=False)
    hold.pop(1)  # written: room again
    assert not hold.add("b", "t1", last=False)  # still cut: its later tokens are refused
    assert hold.add("a", "t1", last=False)  # forgotten: held again
    assert hold.dropped == 4
