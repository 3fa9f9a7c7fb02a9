"""Writing off a queue item the poison guard refused: its dead letter, then the FAILURE results it owes.

:func:`write_dead_letter` pushes the item to the dead-letter list with why, where and when
(:mod:`protocol.deadletter`: ``LPUSH`` then ``LTRIM`` to :data:`~protocol.deadletter.MAX_ENTRIES`, in
one transaction), then, with the guard configured (:mod:`broker.guard_config`), stores a FAILURE result
under the item's task ID when it has one (through the app's result backend, as Celery stores a task's
failure) and under each request ID a ``fleet.infer_bulk`` item carries. The error stored
(:func:`failure_of`) names the field that broke. A write that fails is logged, not raised: the guard
must never become what stops the worker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import SimpleNamespace
from typing import Any

from broker.guard_config import GuardConfig
from broker.message_check import Refused, bulk_request_ids
from protocol.deadletter import DEAD_LETTERED, MAX_ENTRIES, Reason, encode_entry, make_entry
from protocol.errors import DecodeError, FleetError, InvalidRequest
from protocol.keys import DEAD_LETTER_COUNTS_KEY, DEAD_LETTER_KEY

__all__ = ["failure_of", "write_dead_letter"]

log = logging.getLogger("fleet.poison")


def write_dead_letter(
    acquire: Callable[[], AbstractContextManager[Any]],
    cfg: GuardConfig | None,
    queue: str,
    list_key: str,
    item: bytes,
    refused: Refused,
) -> None:
    """Push the entry (on a client from ``acquire``, the channel's ``conn_or_acquire``), then store the
    FAILURE result of the message's task ID (when it has one) and of a bulk message's requests; with no
    ``cfg``, the entry alone (no worker name, no results)."""
    log.error("queue %s: dead-lettered %s (%d bytes, task id %s): %s: %s", queue, refused.reason.value,
              len(item), refused.task_id, refused.field, refused.detail)
    entry = make_entry(item, reason=refused.reason, detail=refused.detail, field=refused.field, queue=queue,
                       list_key=list_key, now_unix_s=time.time(), task_id=refused.task_id, task=refused.task,
                       worker=cfg.hostname if cfg else None, deliveries=refused.deliveries)
    try:
        with acquire() as client:
            pipe = client.pipeline(transaction=True)
            pipe.lpush(DEAD_LETTER_KEY, encode_entry(entry))
            pipe.ltrim(DEAD_LETTER_KEY, 0, MAX_ENTRIES - 1)
            pipe.execute()
            _count(client, refused)
    except Exception:  # the guard must never become the thing that kills the worker
        log.exception("could not write the dead letter")
    if cfg is None:
        return
    error = failure_of(refused)
    if refused.task_id is not None:
        _store_failure(cfg, refused.task_id, refused.task, queue, error)
    _fail_requests_of_bulk(cfg, item, error)  # a bulk message's requests each wait on their own ID


def _count(client: Any, refused: Refused) -> None:
    """One more dead letter of its reason (``fleet_dead_lettered_total``); apart from the entry's transaction,
    so a Redis user allowed to push the entry but not this write still keeps the entry (logged)."""
    try:
        client.hincrby(DEAD_LETTER_COUNTS_KEY, refused.reason.value, 1)
    except Exception:
        log.warning("could not count the dead letter (%s) in %s", refused.reason.value, DEAD_LETTER_COUNTS_KEY,
                    exc_info=True)  # fmt: skip


def failure_of(refused: Refused) -> FleetError:
    """The error stored for a dead-lettered message: DecodeError naming the field that broke; a plain
    FleetError (field ``deliveries``, limit ``max_deliveries``) for one that killed its workers; InvalidRequest
    (field ``headers.eta``, limit the seconds ahead allowed) for an ETA too far ahead."""
    message = f"{DEAD_LETTERED} ({refused.reason.value}): {refused.detail}"
    if refused.reason is Reason.MAX_DELIVERIES:
        return FleetError(message, refused.field, int(refused.limit))
    if refused.reason is Reason.ETA_BEYOND_VISIBILITY:  # a well-formed request that broke a limit
        return InvalidRequest(message, refused.field, float(refused.limit))
    return DecodeError(message, refused.field, refused.limit)


def _store_failure(cfg: GuardConfig, task_id: str, task: str | None, queue: str, error: FleetError) -> None:
    """FAILURE for ``task_id`` through the app's result backend, as Celery stores a failed task's.

    The backend never overwrites a SUCCESS (a stray copy of a finished request fails nothing).
    """
    request = SimpleNamespace(
        id=task_id, task=task, args=None, kwargs=None, hostname=cfg.hostname, retries=0,
        delivery_info={"routing_key": queue}, chord=None, chain=None, errbacks=None, group=None,
        parent_id=None, children=[], stamps=None, ignore_result=False,
    )
    try:
        cfg.app.backend.mark_as_failure(task_id, error, request=request, call_errbacks=False)
    except Exception:
        log.exception("could not store the FAILURE result of %s", task_id)


def _fail_requests_of_bulk(cfg: GuardConfig, item: bytes, error: FleetError) -> None:
    """FAILURE for each request ID a dead-lettered ``fleet.infer_bulk`` item carries (kept where an outcome
    is stored already)."""
    request_ids = bulk_request_ids(item)
    if not request_ids:
        return
    try:
        cfg.app.backend.store_many([(rid, "FAILURE", error) for rid in request_ids])
    except Exception:
        log.exception("could not store the FAILURE results of the %d requests of a bulk message", len(request_ids))
