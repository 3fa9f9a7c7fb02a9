"""The dead-letter list from the operator's side: read, requeue, purge (``fleet dead-letter``).

Entries are :class:`protocol.deadletter.DeadLetter` JSON items on the Redis list
``fleet:dead-letter``, newest first; workers only ever push to it. Here entries are found by
their own ID or by the task ID they carry, and removed by value (``LREM``), so a worker pushing
meanwhile never disturbs an operation. :meth:`DeadLetterStore.page` reads them a page at a time from the
cursor's place (:mod:`producer.deadletter_paging`: one window per page, never the whole list).

A requeue puts back one copy per request ID (:mod:`producer.deadletter_requeue`): the entry it is given (given
a task ID, the newest entry carrying it: the last copy a worker saw). Every ID it puts back (its task ID and a
bulk message's request IDs) is claimed (:data:`protocol.deadletter.REQUEUED_KEY`) until it has an outcome; a
bulk message's requests that another requeue put back meanwhile, or that have an outcome, are dropped from the
message put back, and an entry whose every request is out or done is refused, naming them. The other entries
whose every request ID went back are marked ``superseded_by`` it, so neither a second entry (of the same task
ID or another bulk carrying the request) nor a second operator queues a request twice.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Any, NamedTuple

from broker import bulk_item_without, bulk_request_ids, item_eta_too_far
from producer.deadletter_paging import DEFAULT_PAGE, DeadLetterPage, read_page
from producer.deadletter_requeue import REQUEUE_SCRIPT, BulkPlan, carried_ids, plan_bulk
from protocol.deadletter import (
    DEAD_LETTERED,
    MAX_RAW_BYTES,
    REQUEUE_CLAIM_TTL_S,
    REQUEUED_KEY,
    UNKNOWN_QUEUE,
    DeadLetter,
    Reason,
    encode_entry,
    read_entry,
    requeue_allowed,
)
from protocol.errors import InvalidRequest, RequestNotFound
from protocol.keys import DEAD_LETTER_KEY, DELIVERIES_KEY, RESULT_KEY
from protocol.settings import shared_queue_of

__all__ = ["DeadLetterPage", "DeadLetterStore", "Requeued", "fresh_delivery", "requeue_refusal"]

# A window of the list for a page (producer.deadletter_paging.read_page), in one step: its length, then up to
# ARGV[2] items from the one ARGV[1] places from the oldest ('' = the newest) towards the oldest.
_WINDOW = """
local length = redis.call('LLEN', KEYS[1])
local start = 0
if ARGV[1] ~= '' then start = math.max(0, length - 1 - tonumber(ARGV[1])) end
local items = redis.call('LRANGE', KEYS[1], start, start + tonumber(ARGV[2]) - 1)
table.insert(items, 1, length)
return items
"""
_PLAN_TRIES = 5
"""Plans of a bulk requeue tried when other requeues keep claiming its request IDs meanwhile."""


class Requeued(NamedTuple):
    """What :meth:`DeadLetterStore.requeue` did."""

    entry: DeadLetter
    """The entry whose message went back (now off the list)."""
    failures_cleared: int
    """FAILUREs its dead-lettering stored, removed so the copy stores its own outcome."""
    outcomes_kept: int
    """Other outcomes stored under the IDs it carries, kept (the result store never replaces one)."""
    superseded: int
    """Other entries whose every request ID it put back (its task ID's), marked ``superseded_by`` it (kept on
    the list, refused while that copy is out)."""
    dropped: tuple[str, ...] = ()
    """Request IDs of its bulk message left out of the message put back: another requeue put them back and they
    have no outcome yet, or an outcome is stored that its dead-lettering did not store."""


def _find_in(entries: list[tuple[bytes, DeadLetter]], ident: str) -> tuple[bytes, DeadLetter]:
    """:meth:`DeadLetterStore.find` over entries read already."""
    for item, entry in entries:
        if entry.id == ident:
            return item, entry
    for item, entry in entries:
        if entry.task_id == ident:
            return item, entry
    raise RequestNotFound(f"no dead-letter entry with ID or task ID {ident!r}", "id", None)


def _claim_words(claim: Any) -> str:
    """``(entry E, at T)`` of a requeue claim (JSON, as stored or as the script returns it)."""
    try:
        doc = json.loads(claim)
        by, at = str(doc["entry"]), datetime.fromtimestamp(float(doc["at_unix_s"]), UTC).isoformat(timespec="seconds")
    except (ValueError, TypeError, KeyError):
        by, at = "another entry", "an unknown time"
    return f"(entry {by}, at {at})"


def _claimed(entry: DeadLetter, claim: Any) -> str:
    """Why ``entry`` is not requeued while its task ID's claim stands, in words."""
    return (f"request {entry.task_id} was requeued already {_claim_words(claim)} and has no outcome yet: that copy "
            f"is still queued or running, and a second one would run it twice. Entry {entry.id} is kept; once the "
            f"request has an outcome, a requeue of it is refused as having nothing to requeue, or (dead-lettered "
            f"again) goes back")


def _all_dropped(entry: DeadLetter, plan: BulkPlan) -> InvalidRequest:
    """The refusal of a bulk entry none of whose requests may go back (:func:`plan_bulk`), naming them."""
    parts = []
    if plan.out:
        parts.append("; ".join(f"request {rid} was requeued already {_claim_words(claim)} and has no outcome yet"
                               for rid, claim in plan.out.items()))  # fmt: skip
    if plan.done:
        parts.append("; ".join(f"request {rid} already has an outcome stored ({status}) that its dead-lettering did "
                               "not store" for rid, status in plan.done.items()))  # fmt: skip
    limit = "requeued" if plan.out else next(iter(plan.done.values()))
    head = "" if plan.out else "nothing to requeue: "
    return InvalidRequest(
        f"{head}none of the {len(plan.out) + len(plan.done)} requests of bulk entry {entry.id} (task "
        f"{entry.task_id}) may go back: {'; '.join(parts)}. Running them again would run a request twice; entry "
        f"{entry.id} is kept: requeue it once those copies have outcomes, or `fleet dead-letter delete {entry.id}`",
        "id", limit,
    )


def fresh_delivery(item: bytes) -> bytes:
    """``item`` without kombu's ``redelivered`` marks, so a requeued message counts its deliveries anew.

    Anything that is not a JSON envelope with those marks comes back unchanged, byte for byte.
    """
    try:
        doc = json.loads(item)
    except ValueError:
        return item
    changed = False
    if isinstance(doc, dict):
        headers, props = doc.get("headers"), doc.get("properties")
        info = props.get("delivery_info") if isinstance(props, dict) else None
        for part in (headers, info):
            if isinstance(part, dict) and "redelivered" in part:
                del part["redelivered"]
                changed = True
    return json.dumps(doc).encode("utf-8") if changed else item


def requeue_refusal(entry: DeadLetter, *, now_unix_s: float, visibility_timeout_s: float | None) -> str | None:
    """Why a worker would refuse ``entry``'s message again were it requeued at ``now_unix_s`` (Unix s), in words;
    None when it would take it.

    An ``eta_beyond_visibility`` entry is refused again while its ETA is still further ahead than
    ``visibility_timeout_s`` allows (:func:`broker.max_eta_ahead_s`), and taken (run at its ETA, or at once
    when that has passed) from then on; without ``visibility_timeout_s`` it counts as refused. Other reasons:
    :func:`protocol.deadletter.requeue_allowed`.
    """
    why = f"entry {entry.id} was dead-lettered as {entry.reason.value} ({entry.detail})"
    if entry.reason is Reason.ETA_BEYOND_VISIBILITY and visibility_timeout_s is not None:
        too_far = item_eta_too_far(entry.raw_bytes(), now_unix_s=now_unix_s, visibility_timeout_s=visibility_timeout_s)
        if too_far is None:
            return None
        in_reach = datetime.fromtimestamp(too_far.in_reach_at_unix_s, UTC).isoformat(timespec="seconds")
        return (f"entry {entry.id} was dead-lettered as {entry.reason.value}, and its {too_far.summary()} still: a "
                f"worker would refuse it again until {in_reach}, and take it from then on (to run at its ETA)")
    return None if requeue_allowed(entry.reason, entry.task) else f"{why}; a worker would refuse it again"


class DeadLetterStore:
    """Operations on the dead-letter list of one Redis (a redis-py client returning bytes).

    ``visibility_timeout_s`` is the fleet's (:class:`protocol.settings.FleetSettings`): with it, an
    ``eta_beyond_visibility`` entry whose ETA has come within reach requeues without ``force``.
    """

    def __init__(
        self, client: Any, visibility_timeout_s: float | None = None, requeue_claim_ttl_s: int = REQUEUE_CLAIM_TTL_S
    ) -> None:
        """``requeue_claim_ttl_s``: how long a requeued task ID refuses another requeue while it has no outcome
        (s; the CLI passes the fleet's ``result_ttl_s``)."""
        if requeue_claim_ttl_s < 1:
            raise InvalidRequest(f"requeue_claim_ttl_s must be >= 1 s, got {requeue_claim_ttl_s}",
                                 "requeue_claim_ttl_s", 1)  # fmt: skip
        self.client = client
        self.visibility_timeout_s = visibility_timeout_s
        self.requeue_claim_ttl_s = requeue_claim_ttl_s

    def refusal(self, entry: DeadLetter, now_unix_s: float | None = None) -> str | None:
        """:func:`requeue_refusal` for ``entry`` now (or at ``now_unix_s``), with this store's visibility timeout."""
        now = time.time() if now_unix_s is None else now_unix_s  # wall clock: an ETA is a wall-clock time
        return requeue_refusal(entry, now_unix_s=now, visibility_timeout_s=self.visibility_timeout_s)

    def entries(self) -> list[tuple[bytes, DeadLetter]]:
        """Every entry, newest first, with the list item it was read from."""
        return [(item, read_entry(item)) for item in self.client.lrange(DEAD_LETTER_KEY, 0, -1)]

    def page(self, limit: int = DEFAULT_PAGE, after: str | None = None) -> DeadLetterPage:
        """Up to ``limit`` entries (0 = all), newest first, starting after the cursor ``after`` (a page's
        ``next_cursor``, or an entry ID; None: from the newest); the page's ``next_cursor`` is what to pass as
        ``after`` for the next one (None: no more). Read in windows from the cursor's place
        (:func:`producer.deadletter_paging.read_page`): a page's round trips and bytes grow with ``limit``, not
        with the list.

        Raises:
            InvalidRequest: ``limit`` is not an integer >= 0, or ``after`` names no entry on the list (field
                ``after``: requeued, deleted, purged or trimmed since it was shown).
        """
        return read_page(self._window, limit=limit, after=after)

    def _window(self, from_tail: int | None, count: int) -> tuple[int, list[bytes]]:
        """:data:`producer.deadletter_paging.ReadWindow` on this store's list (one script: one round trip)."""
        reply = self.client.eval(_WINDOW, 1, DEAD_LETTER_KEY, "" if from_tail is None else str(from_tail), str(count))
        return int(reply[0]), list(reply[1:])

    def find(self, ident: str) -> tuple[bytes, DeadLetter]:
        """The entry with ID ``ident``, else the newest entry whose task ID is ``ident``.

        Raises:
            RequestNotFound: no such entry.
        """
        return _find_in(self.entries(), ident)

    def requeue(self, ident: str, *, force: bool = False) -> Requeued:
        """Push the entry's message back onto the list it came from (the model's queue, for a message
        taken from a worker's own queue) and remove the entry.

        Its delivery count is reset (and its ``redelivered`` marks dropped), so it gets
        ``max_deliveries`` deliveries again, and the FAILURE stored when it was dead-lettered is removed
        (its task's, and each request's of a bulk message), so it runs to a new outcome: the requeued copy's.
        Any other stored outcome is kept (the store never replaces one). One copy per request ID: each ID put
        back is claimed until it has an outcome, a bulk message goes back without the requests another requeue
        put back or that have an outcome (:attr:`Requeued.dropped`), and the other entries whose every request
        went back are marked ``superseded_by`` it (see the module docstring). A plan that other requeues
        overtake (they claim one of its requests first) is made again, up to :data:`_PLAN_TRIES` times.

        Raises:
            RequestNotFound: no such entry (or another operator took it first).
            InvalidRequest: a worker would refuse it again (:meth:`refusal`: a malformed message, or an ETA
                still too far ahead; ``force`` pushes it anyway); its queue is unknown (an item from before
                entries had a schema, with no routing key); nothing to requeue: every ID it carries has an
                outcome stored already that its dead-lettering did not store (a copy that ran): it would run
                for nothing, and the entry is kept (:meth:`delete` removes it); or its task ID was requeued
                already and has no outcome yet, or (a bulk message) every request it carries was, or has an outcome
                (field ``id``, limit ``requeued``, the IDs named: that copy is still queued or running; ``force``
                does not override it). Nothing changes in each case.
        """
        for _ in range(_PLAN_TRIES):
            done = self._requeue_once(ident, force=force)
            if done is not None:
                return done
        raise InvalidRequest(f"entry {ident}: other requeues kept claiming the requests of its bulk message while "
                             f"this one planned ({_PLAN_TRIES} tries); nothing changed: requeue it again",
                             "id", "requeued")  # fmt: skip

    def _requeue_once(self, ident: str, *, force: bool) -> Requeued | None:
        """One try of :meth:`requeue`; None when a request of its bulk message was claimed meanwhile (plan again)."""
        entries = self.entries()
        stored, entry = _find_in(entries, ident)
        if entry.reason is Reason.LEGACY and entry.list_key == UNKNOWN_QUEUE:
            raise InvalidRequest(f"entry {entry.id} has no queue to go back to (an item pushed before dead-letter "
                                 "entries had a schema, without a routing key): `fleet dead-letter show` it and "
                                 "send it again yourself, or delete it", "queue", UNKNOWN_QUEUE)  # fmt: skip
        if entry.raw_truncated_from is not None:  # --force or not: the message is not whole
            raise InvalidRequest(f"entry {entry.id} keeps only the first {len(entry.raw_bytes())} of its item's "
                                 f"{entry.raw_truncated_from} bytes (sha256 {entry.raw_sha256}): it cannot be "
                                 "requeued; `fleet dead-letter show` it, and send the message again yourself", "raw",
                                 MAX_RAW_BYTES)  # fmt: skip
        refusal = None if force else self.refusal(entry)
        if refusal is not None:
            raise InvalidRequest(f"{refusal}. Use --force to requeue it anyway", "force", entry.reason.value)
        deliveries_key = DELIVERIES_KEY.format(id=entry.task_id or "")
        target = shared_queue_of(entry.list_key)  # a worker's own queue: onto the model's (that worker may be gone)
        item = entry.raw_bytes()
        request_ids = [rid for rid in bulk_request_ids(item) if rid != entry.task_id]
        plan = plan_bulk(self.client, request_ids) if request_ids else BulkPlan([], {}, {})
        if request_ids and not plan.put_back:
            raise _all_dropped(entry, plan)
        dropped = (*plan.out, *plan.done)
        message = fresh_delivery(bulk_item_without(item, set(dropped)) if dropped else item)
        ids = [*([entry.task_id] if entry.task_id else []), *plan.put_back]
        running = set(plan.put_back) or ({entry.task_id} if entry.task_id else set())
        claim = json.dumps({"entry": entry.id, "at_unix_s": time.time()})  # wall clock: shown to operators
        siblings: list[bytes] = []
        for sibling_item, sibling in entries:
            if sibling.id == entry.id:
                continue
            same_task = entry.task_id is not None and sibling.task_id == entry.task_id
            if same_task or (running and carried_ids(sibling) <= running):
                siblings += [sibling_item, encode_entry(sibling.model_copy(update={"superseded_by": entry.id}))]
        keys = [key for i in ids for key in (RESULT_KEY.format(id=i), REQUEUED_KEY.format(id=i))]
        done, count, kept, found = self.client.eval(
            REQUEUE_SCRIPT, 3 + len(keys), DEAD_LETTER_KEY, target, deliveries_key, *keys, stored, message,
            DEAD_LETTERED, claim, str(self.requeue_claim_ttl_s), "1" if entry.task_id else "0", *siblings,
        )
        if done == 4:
            return None
        if done == 0:
            raise RequestNotFound(f"dead-letter entry {entry.id} was removed or changed meanwhile (requeued, deleted, "
                                  "or marked superseded by another requeue of its task ID)", "id", None)  # fmt: skip
        if done == 2:
            status = kept.decode() if isinstance(kept, bytes) else str(kept)
            raise InvalidRequest(
                f"nothing to requeue: its request {entry.task_id} already has an outcome stored ({status}) that its "
                f"dead-lettering did not store (a copy ran meanwhile); the result store never replaces it, so the "
                f"message would run for nothing. Entry {entry.id} is kept: `fleet dead-letter delete {entry.id}` "
                "removes it", "id", status,
            )
        if done == 3:
            raise InvalidRequest(_claimed(entry, found), "id", "requeued")
        return Requeued(entry, int(count), int(kept), int(found), tuple(dropped))

    def delete(self, ident: str) -> DeadLetter:
        """Remove the entry with ID (or newest with task ID) ``ident``, nothing else; returns it.

        Raises:
            RequestNotFound: no such entry (or another operator removed or requeued it first).
        """
        stored, entry = self.find(ident)
        if not self.client.lrem(DEAD_LETTER_KEY, 1, stored):
            raise RequestNotFound(f"dead-letter entry {entry.id} was removed meanwhile", "id", None)
        return entry

    def purge(self, *, older_than_s: float, now_unix_s: float) -> int:
        """Remove the entries dead-lettered more than ``older_than_s`` ago; returns how many went."""
        removed = 0
        for item, entry in self.entries():
            if now_unix_s - entry.dead_lettered_at_unix_s > older_than_s:
                removed += int(self.client.lrem(DEAD_LETTER_KEY, 1, item))
        return removed

    def purge_all(self) -> int:
        """Remove every entry; returns how many there were."""
        pipe = self.client.pipeline(transaction=True)
        pipe.llen(DEAD_LETTER_KEY)
        pipe.delete(DEAD_LETTER_KEY)
        count, _ = pipe.execute()
        return int(count)

    def count(self) -> int:
        """Entries in the list now."""
        return int(self.client.llen(DEAD_LETTER_KEY))
