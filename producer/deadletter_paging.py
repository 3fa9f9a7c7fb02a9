"""Pages of the dead-letter list (``fleet dead-letter list --limit N --after CURSOR``), read a window at a time.

The list is newest first and workers only push to its front, so a page is named by the entry before it:
``next_cursor`` is the ID of the last entry a page shows with its place counted from the oldest entry
(``<id>@<place>``), and the next page starts right after that entry, wherever it has moved since. Entries
dead-lettered meanwhile land in front of the first page and never shift or repeat a later one (nor the place);
entries requeued, deleted or purged meanwhile simply no longer appear. :func:`read_page` reads a page from its
cursor's place in windows (``LRANGE``), so a page costs Redis what its entries do, not the whole list; a cursor
whose entry is gone itself (requeued, deleted, purged, or trimmed past the newest
:data:`~protocol.deadletter.MAX_ENTRIES`) is refused by name rather than guessed at: list again from the top.
:func:`page_of` is the same page over entries read already.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from protocol.deadletter import MAX_ENTRIES, DeadLetter, read_entry
from protocol.errors import InvalidRequest

__all__ = ["DEFAULT_PAGE", "SCAN_SLACK", "DeadLetterPage", "ReadWindow", "cursor_of", "page_of", "read_page"]

DEFAULT_PAGE = 100
"""Entries a page holds when the caller gives no limit."""


@dataclass(frozen=True)
class DeadLetterPage:
    """One page: its entries (newest first), the entries on the list in all, and the next page's cursor."""

    entries: list[DeadLetter]
    count: int
    """Entries on the whole list when it was read."""
    next_cursor: str | None
    """The ``after`` of the next page (the last entry's ID); None when this page reaches the oldest entry."""


def page_of(entries: Sequence[tuple[bytes, DeadLetter]], *, limit: int, after: str | None) -> DeadLetterPage:
    """The page of ``entries`` (newest first, as read) of at most ``limit`` entries (0 = all) after the entry
    with ID ``after`` (None: from the first).

    Raises:
        InvalidRequest: ``limit`` is not an integer from 0 to :data:`MAX_ENTRIES` (field ``limit``); ``after``
            is empty or names no entry in ``entries`` (field ``after``).
    """
    if isinstance(limit, bool) or not isinstance(limit, int) or not 0 <= limit <= MAX_ENTRIES:
        raise InvalidRequest(f"limit must be an integer from 0 to {MAX_ENTRIES} (0 = all), got {limit!r}",
                             "limit", f"0..{MAX_ENTRIES}")  # fmt: skip
    start = 0
    if after is not None:
        ids = [entry.id for _, entry in entries]
        if not after or after not in ids:
            raise InvalidRequest(
                f"after: no dead-letter entry {after!r} on the list (requeued, deleted, purged, or trimmed past the "
                f"newest {MAX_ENTRIES:,} since its page was shown): list again without --after",
                "after",
                "an entry ID on the list",
            )
        start = ids.index(after) + 1
    end = len(entries) if limit == 0 else min(len(entries), start + limit)
    shown = [entry for _, entry in entries[start:end]]
    more = end < len(entries) and bool(shown)
    return DeadLetterPage(entries=shown, count=len(entries), next_cursor=shown[-1].id if more else None)



ReadWindow = Callable[[int | None, int], tuple[int, list[bytes]]]
"""``read(from_tail, count)`` → (the list's length, up to ``count`` items, newest first, starting at the item
``from_tail`` places from the oldest (0 = the oldest; None: the newest) and going older), in one atomic step."""

SCAN_SLACK = 64
"""Items a page read takes beyond the page, so that a cursor whose entry moved (entries older than it removed
meanwhile) is still found in the same read."""


def cursor_of(entry_id: str, from_tail: int) -> str:
    """A page's ``next_cursor``: the last entry's ID and its place counted from the oldest entry (0 = oldest).
    Entries arriving at the head never change that place; removals and trims move it only towards 0."""
    return f"{entry_id}@{from_tail}"


def _parse_cursor(after: str) -> tuple[str, int | None]:
    """(entry ID, its place from the tail when the cursor carries one: a bare ID is looked for from the newest)."""
    ident, at, place = after.rpartition("@")
    if at and ident and place.isdigit():
        return ident, int(place)
    return after, None


def read_page(read: ReadWindow, *, limit: int, after: str | None) -> DeadLetterPage:
    """The page of at most ``limit`` entries (0 = all) after the cursor ``after`` (None: from the newest), read in
    windows of ``limit + 1 + SCAN_SLACK`` items from where the cursor's entry was (:func:`cursor_of`), never the
    whole list: the entry is at that place or nearer the tail (only removals of older entries move it, never
    towards the head), so the scan goes from there towards the tail and ends in the first window unless more than
    :data:`SCAN_SLACK` older entries went meanwhile. Round trips and bytes per page depend on ``limit``, not on
    the list's length.

    Raises:
        InvalidRequest: as :func:`page_of` (field ``limit``; field ``after``: empty, or no such entry on the list).
    """
    page_of([], limit=limit, after=None)  # the limit's check
    if limit == 0:
        length, items = read(None, MAX_ENTRIES + 1)
        return _page(items, length, limit=0, after=after, first_place=length - 1)
    if after is None:
        length, items = read(None, limit + 1)
        return _page(items, length, limit=limit, after=None, first_place=length - 1)
    ident, place = _parse_cursor(after)
    if not ident:
        page_of([], limit=limit, after=ident)  # raises: an empty cursor
    want = limit + 1 + SCAN_SLACK
    while True:
        length, items = read(place, want)
        first = length - 1 if place is None else min(place, length - 1)
        ids = [read_entry(item).id for item in items]
        at_end = first - len(items) < 0
        if ident in ids:
            found = ids.index(ident)
            if len(items) - found - 1 > limit or at_end:
                return _page(items, length, limit=limit, after=ident, first_place=first)
            place = first - found  # found near the window's end: read the page from it
            continue
        if at_end:
            page_of([], limit=limit, after=ident)  # raises: no such entry
        place = first - len(items)


def _page(items: list[bytes], length: int, *, limit: int, after: str | None, first_place: int) -> DeadLetterPage:
    """The page of the window ``items`` (newest first; the first one ``first_place`` places from the oldest entry
    of a list of ``length``) after the entry ``after`` (None: from the window's first)."""
    entries = [(item, read_entry(item)) for item in items]
    page = page_of(entries, limit=limit, after=after)
    if page.next_cursor is None:
        return DeadLetterPage(entries=page.entries, count=length, next_cursor=None)
    offset = 0 if after is None else [e.id for _, e in entries].index(after) + 1
    last_place = first_place - offset - (len(page.entries) - 1)
    return DeadLetterPage(entries=page.entries, count=length, next_cursor=cursor_of(page.entries[-1].id, last_place))
