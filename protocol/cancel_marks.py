"""A request's cancel mark, and whether it says the request is cancelled for good.

A cancel is a mark in Redis (``fleet:cancel:<id>``) that the worker taking the request reads in the round trip
that takes it (:mod:`broker.atomic_take`); it used to be read by every client as "cancelled" as soon as it was
set. But a one-step request a worker had already taken may have started its batch: it then ends with its result
(an engine step is not stopped part way), and a client that had read "cancelled" (``GET /v1/requests/<id>``,
``DELETE``'s own answer, a long poll that ended on the mark) later read "succeeded": two terminal states for one
request ID.

So a worker that takes a request and finds no mark notes the take (``fleet:taken:<id>``, in the same script run,
or before it reads the mark where it takes with ``BRPOP``), and a cancel is written by one script,
:data:`MARK_SCRIPT`, that reads the note:

* no note: the mark's value is ``1``, **cancelled for good**: the take, whenever it comes, finds the mark and
  drops the request;
* a note: the value is ``held``, a cancel asked of the worker that holds the request: it drops the request if it
  still waits for its batch (and stores that it was cancelled) or runs it (and stores its result); readers wait
  for what it stores.

Readers use :func:`cancelled_for_good` on the mark's value, and a cancel for good wins over a STARTED state
(a generation's worker, or one with ``celery.track_started``, stores it before it reads the mark, then drops
the request): only a stored outcome beats it. Workers read any value as a cancel. A cancel for good stays one
when cancelled again.
"""

from __future__ import annotations

import json
from typing import Any

from protocol.keys import CANCEL_CHANNEL, CANCEL_KEY, RESULT_KEY, TAKEN_KEY

__all__ = ["FOR_GOOD", "HELD", "MARK_SCRIPT", "cancel_wake", "cancelled_before_run", "cancelled_for_good", "mark_args",
           "mark_keys", "note_taken_and_read"]

FOR_GOOD = "1"
"""The mark's value when no worker held the request: it never runs."""
HELD = "held"
"""The mark's value when a worker held the request: it ends with what that worker stores."""

MARK_SCRIPT = f"""
local held = redis.call('EXISTS', KEYS[2], KEYS[3]) > 0 and redis.call('GET', KEYS[1]) ~= '{FOR_GOOD}'
redis.call('SET', KEYS[1], held and '{HELD}' or '{FOR_GOOD}', 'EX', ARGV[1])
redis.call('PUBLISH', ARGV[2], ARGV[3])
if held then return 1 end
if ARGV[4] then redis.call('PUBLISH', KEYS[3], ARGV[4]) end
return 0
"""
"""Set one request's cancel mark and announce it. KEYS: its cancel mark, its taken note, its result key (a
STARTED state there says a worker runs it, whatever became of the note); ARGV: the mark's life (s), the cancels
channel, the request ID, and the wake-up published on the result key's channel when the cancel is for good
(:func:`cancel_wake`). Returns 1 when the cancel was asked of a worker that holds the request (value
``held``), 0 when it is for good (``1``: no take noted and no state stored, or cancelled for good already).
The caller has seen no terminal state stored: a cancel of a finished request writes nothing.

The wake-up is what ends every wait on the request at once: a result waiter listens on the result key's
channel, and a request cancelled for good has no worker that will ever publish there until one takes it off the
queue (never, with no worker up). Woken, a waiter reads the key and the mark (:func:`cancelled_before_run`)."""


def mark_keys(request_id: str) -> list[str]:
    """:data:`MARK_SCRIPT`'s keys for ``request_id``."""
    return [CANCEL_KEY.format(id=request_id), TAKEN_KEY.format(id=request_id), RESULT_KEY.format(id=request_id)]


def mark_args(request_id: str, ttl_s: int) -> list[Any]:
    """:data:`MARK_SCRIPT`'s arguments: the mark lives ``ttl_s`` seconds (the fleet's ``result_ttl_s``)."""
    return [int(ttl_s), CANCEL_CHANNEL, request_id, cancel_wake(request_id)]


def cancel_wake(request_id: str) -> str:
    """What a cancel for good publishes on the request's result channel: a Celery result meta in a state that is
    not ready (``PENDING``), so a plain Celery client's ``AsyncResult`` ignores it, and the fleet's waiters, which
    read the key and the mark again on any message that is not an outcome, end at once (:func:`cancelled_before_run`).
    Nothing is stored: the outcome stays what the worker that takes the request off the queue stores."""
    return json.dumps({"status": "PENDING", "result": None, "traceback": None, "children": [], "task_id": request_id,
                       "fleet_cancelled": FOR_GOOD})  # fmt: skip


def cancelled_before_run(raw_meta: bytes | None, mark: bytes | str | None) -> bool:
    """Whether a request whose result key holds ``raw_meta`` (None: nothing stored) and whose cancel mark is
    ``mark`` (None: none) is cancelled while it was queued: nothing stored, not even STARTED, and the mark is for
    good. Its waiters end with ``RequestCancelled.before_run``; no worker may ever store why (one that takes it
    off the queue stores that same error, and a cancel asked of a holder waits for what the holder stores)."""
    return raw_meta is None and cancelled_for_good(mark)


def cancelled_for_good(value: bytes | str | None) -> bool:
    """Whether a cancel mark's value (None: no mark) says the request is cancelled and never runs."""
    if value is None:
        return False
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    return text != HELD


def note_taken_and_read(client: Any, request_ids: list[str], note_life_s: int) -> dict[str, bool]:
    """A worker about to run ``request_ids`` whose marks were not read as they were taken (the requests of a bulk
    message, a delivery without a noted mark): their taken notes (each living ``note_life_s`` s, the visibility
    timeout), then their cancel marks, in one pipeline; returns ``{request_id: cancelled}``.

    The notes go first: a cancel written before them is for good and the read finds it (the request is dropped);
    one written after them is asked of this worker (it runs, or drops it, and stores that)."""
    if not request_ids:
        return {}
    with client.pipeline(transaction=False) as pipe:
        for rid in request_ids:
            pipe.set(TAKEN_KEY.format(id=rid), "1", ex=max(1, int(note_life_s)))
        pipe.mget([CANCEL_KEY.format(id=rid) for rid in request_ids])
        replies = pipe.execute()
    return {rid: value is not None for rid, value in zip(request_ids, replies[-1], strict=True)}
