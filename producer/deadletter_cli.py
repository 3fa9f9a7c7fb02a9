"""``fleet dead-letter list|show|requeue|delete|purge``: the queue items workers refused or gave up on.

``producer.cli`` calls :func:`register` with its sub-parsers. Every command prints one JSON
document. Exit codes follow ``fleet``'s: 0 ok; 1 no such entry, Redis unreachable; 2 refused (a malformed
message without ``--force``, nothing to requeue, bad arguments or settings).

::

    fleet dead-letter list [--limit N] [--after CURSOR]
                                                # newest first: id, reason, field, queue, task id, when;
                                                # N per page (default 100, 0 = all), "next_cursor" for --after
    fleet dead-letter show ID                   # the full entry, raw message included (ID or task ID)
    fleet dead-letter requeue ID [ID ...] [--force]
                                                # the message back onto its queue, deliveries counted anew
                                                # (refused, unless forced, when a worker would refuse it again)
                                                # (refused when each ID it carries has an outcome stored
                                                # that its dead-lettering did not store: nothing to requeue)
                                                # one copy per request ID: each ID put back is claimed until
                                                # it has an outcome; a bulk message goes back without the
                                                # requests already out or done ("dropped"); entries whose
                                                # every request went back are marked superseded
    fleet dead-letter delete ID                 # remove one entry
    fleet dead-letter purge --older-than S | --all
"""

from __future__ import annotations

import argparse
import json
import math
import time
from datetime import UTC, datetime
from typing import Any

from producer.cli_types import number_in
from producer.deadletter import DeadLetterStore, Requeued
from producer.deadletter_paging import DEFAULT_PAGE
from protocol.deadletter import MAX_ENTRIES, DeadLetter
from protocol.errors import FleetError
from protocol.redis_conn import sync_client
from protocol.settings import FleetSettings, load_settings

__all__ = ["register"]


def _print(doc: Any) -> None:
    print(json.dumps(doc))


def _settings(args: argparse.Namespace) -> FleetSettings:
    return load_settings(args.config)


def _store(settings: FleetSettings) -> DeadLetterStore:
    return DeadLetterStore(sync_client(settings, socket_timeout=10), visibility_timeout_s=settings.visibility_timeout_s,
                           requeue_claim_ttl_s=settings.result_ttl_s)  # fmt: skip


def _when(entry: DeadLetter) -> str:
    return datetime.fromtimestamp(entry.dead_lettered_at_unix_s, UTC).isoformat(timespec="seconds")


def cmd_list(args: argparse.Namespace) -> int:
    store = _store(_settings(args))
    page = store.page(limit=args.limit, after=args.after)
    _print({
        "count": page.count,
        "entries": [{**e.summary(), "dead_lettered_at": _when(e)} for e in page.entries],
        "next_cursor": page.next_cursor,
    })
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    store = _store(_settings(args))
    _, entry = store.find(args.id)
    _print({**entry.model_dump(mode="json"), "dead_lettered_at": _when(entry),
            "requeue_allowed": store.refusal(entry) is None})
    return 0


def _requeued_doc(done: Requeued, forced: bool) -> dict[str, Any]:
    entry = done.entry
    return {"id": entry.id, "requeued": True, "task_id": entry.task_id, "queue": entry.queue,
            "list_key": entry.list_key, "reason": entry.reason.value, "forced": forced,
            "failure_cleared": done.failures_cleared > 0, "failures_cleared": done.failures_cleared,
            "outcomes_kept": done.outcomes_kept, "superseded": done.superseded, "dropped": list(done.dropped)}


def cmd_requeue(args: argparse.Namespace) -> int:
    store = _store(_settings(args))
    forced = bool(args.force)
    if len(args.id) == 1:
        # refused (InvalidRequest naming why and --force) when a worker would refuse it again: nothing changes
        # nothing to requeue (InvalidRequest, exit 2) when every ID it carries has an outcome its dead-lettering
        # did not store, or its task ID's copy is out already: the entry is kept
        _print(_requeued_doc(store.requeue(args.id[0], force=forced), forced))
        return 0
    # several: each in turn, so a later entry of a task ID requeued earlier in the call is refused, not run twice
    docs: list[dict[str, Any]] = []
    for ident in args.id:
        try:
            docs.append(_requeued_doc(store.requeue(ident, force=forced), forced))
        except FleetError as exc:
            docs.append({"id": ident, "requeued": False, "type": type(exc).__name__, "message": exc.message,
                         "field": exc.field, "limit": exc.limit})  # fmt: skip
    requeued = sum(1 for d in docs if d["requeued"])
    _print({"requeued": requeued, "refused": len(docs) - requeued,
            "superseded": sum(int(d.get("superseded", 0)) for d in docs), "entries": docs})
    return 0 if requeued == len(docs) else 2


def cmd_delete(args: argparse.Namespace) -> int:
    store = _store(_settings(args))
    entry = store.delete(args.id)
    _print({"id": entry.id, "deleted": True, "task_id": entry.task_id, "reason": entry.reason.value,
            "remaining": store.count()})
    return 0


def cmd_purge(args: argparse.Namespace) -> int:
    store = _store(_settings(args))
    purged = store.purge_all() if args.all else store.purge(older_than_s=args.older_than, now_unix_s=time.time())
    _print({"purged": purged, "remaining": store.count()})
    return 0


_seconds = number_in(float, 0, math.inf, "must be a number of seconds >= 0")
_count = number_in(int, 0, MAX_ENTRIES, f"must be an integer >= 0 and <= {MAX_ENTRIES} (0 = all)")


def _cursor(raw: str) -> str:
    """An argparse ``type`` for ``--after``: a non-empty entry ID (a page's ``next_cursor``)."""
    if not raw.strip():
        raise argparse.ArgumentTypeError("must be a page's next_cursor (an entry ID), got ''")
    return raw


def register(sub: Any) -> None:
    """Add ``dead-letter`` and its sub-commands to the ``fleet`` sub-parsers."""
    p = sub.add_parser("dead-letter", help="list, show, requeue or purge the queue items workers dead-lettered")
    dl = p.add_subparsers(dest="dead_letter_command", required=True)

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--config", default=None, help="YAML settings (default: $FLEET_CONFIG or configs/fleet.yaml)")

    q = dl.add_parser("list", help="entries, newest first: id, reason, field, queue, task id, when")
    common(q)
    q.add_argument("--limit", type=_count, default=DEFAULT_PAGE,
                   help=f"print at most N entries (0 = all; default {DEFAULT_PAGE}, at most {MAX_ENTRIES})")
    q.add_argument("--after", type=_cursor, default=None, metavar="CURSOR",
                   help="start after this entry: the next_cursor a page printed (none: from the newest)")
    q.set_defaults(func=cmd_list)

    q = dl.add_parser("show", help="one entry in full, raw message included")
    common(q)
    q.add_argument("id", help="the entry's ID, or the task ID it carries")
    q.set_defaults(func=cmd_show)

    q = dl.add_parser("requeue", help="push entries' messages back onto their queues and remove the entries "
                      "(one copy per request ID: a bulk message goes back without requests already out or done)")
    common(q)
    q.add_argument("id", nargs="+", help="the entry's ID, or the task ID it carries (its newest entry); several "
                   "are requeued in turn, each reported (exit 2 when any is refused)")
    q.add_argument("--force", action="store_true",
                   help="requeue even a message a worker will dead-letter again (malformed, or its ETA still "
                   "further ahead than the visibility timeout allows)")
    q.set_defaults(func=cmd_requeue)

    q = dl.add_parser("delete", help="remove one entry (its message is not requeued)")
    common(q)
    q.add_argument("id", help="the entry's ID, or the task ID it carries (its newest entry)")
    q.set_defaults(func=cmd_delete)

    q = dl.add_parser("purge", help="remove entries: those older than S seconds, or all")
    common(q)
    which = q.add_mutually_exclusive_group(required=True)
    which.add_argument("--older-than", type=_seconds, metavar="S", help="entries dead-lettered more than S s ago")
    which.add_argument("--all", action="store_true", help="every entry")
    q.set_defaults(func=cmd_purge)
