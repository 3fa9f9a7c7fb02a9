"""Pages of the dead-letter list (``fleet dead-letter list --limit N --after CURSOR``), without Redis.

Before, ``list`` printed the newest ``--limit`` entries and had no way to the ones after them: an operator
could only raise the limit (up to the whole list). Now each page carries ``next_cursor`` (the last entry's
ID) and ``--after`` starts the next page right after that entry, wherever new entries have pushed it.
"""

from __future__ import annotations

import pytest

from producer.cli import build_parser
from producer.deadletter_paging import DEFAULT_PAGE, page_of
from protocol.deadletter import MAX_ENTRIES, DeadLetter, Reason, encode_entry, make_entry
from protocol.errors import InvalidRequest


def _entry(n: int) -> DeadLetter:
    return make_entry(b"item %d" % n, reason=Reason.BAD_BODY, detail="d", field="body", queue="fleet.demo-lm",
                      list_key="fleet.demo-lm", now_unix_s=float(n), task_id=f"t-{n}")  # fmt: skip


def _listing(entries: list[DeadLetter]) -> list[tuple[bytes, DeadLetter]]:
    """As the store reads the list: newest first, each with its item."""
    return [(encode_entry(e), e) for e in entries]


def _walk(listing: list[tuple[bytes, DeadLetter]], limit: int) -> list[list[int]]:
    pages, after = [], None
    while True:
        page = page_of(listing, limit=limit, after=after)
        pages.append([int(e.dead_lettered_at_unix_s) for e in page.entries])
        assert page.count == len(listing)
        if page.next_cursor is None:
            return pages
        after = page.next_cursor


@pytest.mark.parametrize(
    ("n", "limit", "pages"),
    [
        (0, 3, [[]]),
        (5, 0, [[4, 3, 2, 1, 0]]),
        (5, 2, [[4, 3], [2, 1], [0]]),
        (6, 3, [[5, 4, 3], [2, 1, 0]]),  # the last full page says there is no more
        (3, 10, [[2, 1, 0]]),
    ],
)
def test_pages_walk_the_list_newest_first_once(n: int, limit: int, pages: list[list[int]]) -> None:
    listing = _listing([_entry(i) for i in reversed(range(n))])
    assert _walk(listing, limit) == pages


def test_entries_arriving_and_leaving_between_pages_neither_repeat_nor_skip_the_rest() -> None:
    old = [_entry(i) for i in reversed(range(10))]  # 9 (newest) .. 0
    first = page_of(_listing(old), limit=4, after=None)
    assert [e.task_id for e in first.entries] == ["t-9", "t-8", "t-7", "t-6"] and first.next_cursor == old[3].id
    # meanwhile: three new entries in front, one of the first page requeued, one further back deleted
    now = [_entry(i) for i in (12, 11, 10)] + [e for e in old if e.task_id not in {"t-8", "t-2"}]
    second = page_of(_listing(now), limit=4, after=first.next_cursor)
    assert [e.task_id for e in second.entries] == ["t-5", "t-4", "t-3", "t-1"]
    third = page_of(_listing(now), limit=4, after=second.next_cursor)
    assert [e.task_id for e in third.entries] == ["t-0"] and third.next_cursor is None


def test_a_superseded_entry_keeps_its_place_as_a_cursor() -> None:
    entries = [_entry(i) for i in reversed(range(4))]
    first = page_of(_listing(entries), limit=2, after=None)
    marked = [e.model_copy(update={"superseded_by": "x"}) if e.id == first.next_cursor else e for e in entries]
    assert [e.task_id for e in page_of(_listing(marked), limit=2, after=first.next_cursor).entries] == ["t-1", "t-0"]


@pytest.mark.parametrize(("limit", "after", "field"), [
    (-1, None, "limit"), (MAX_ENTRIES + 1, None, "limit"), (True, None, "limit"), (2.5, None, "limit"),
    (5, "", "after"), (5, "no-such-entry", "after"),
])  # fmt: skip
def test_bad_values_are_refused_naming_the_field_and_the_limit(limit: object, after: str | None, field: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        page_of(_listing([_entry(1)]), limit=limit, after=after)  # type: ignore[arg-type]
    assert refused.value.field == field
    if field == "limit":
        assert refused.value.limit == f"0..{MAX_ENTRIES}" and f"from 0 to {MAX_ENTRIES}" in refused.value.message
    else:
        assert "list again without --after" in refused.value.message


def test_the_cli_takes_a_cursor_and_a_bounded_limit(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["dead-letter", "list", "--after", "abc", "--limit", "7"])
    assert (args.after, args.limit) == ("abc", 7)
    assert build_parser().parse_args(["dead-letter", "list"]).limit == DEFAULT_PAGE
    for argv in (["--limit", str(MAX_ENTRIES + 1)], ["--after", " "]):
        with pytest.raises(SystemExit) as exited:
            build_parser().parse_args(["dead-letter", "list", *argv])
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert exited.value.code == 2 and argv[0] in line, line
