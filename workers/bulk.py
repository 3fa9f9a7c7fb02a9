"""``fleet.infer_bulk``: many requests in one Celery message, one result per request ID.

One Celery task per request costs a few CPU-milliseconds of broker and result-backend work per
request; producers that need more requests/s send up to ``MAX_BULK_REQUESTS`` requests per message.
The worker validates each request on its own (a bad one fails alone), hands all valid ones to the
scheduler at once, and writes every result under its own ``celery-task-meta-<request_id>`` key in
one Redis pipeline, in Celery's own format, so ``AsyncResult(request_id)``, ``FleetClient.result``
and the HTTP gateway read them like any other result. Flower shows the bulk task, not each request.

One ID names one request inside a message too (a plain Celery producer may repeat one): a repeat with the
same body is that request, run once and answered once; a repeat with another body is refused
(:class:`~protocol.errors.IdempotencyConflict`, not run: the ID's result is its first item's). An item whose
error cannot be stored under an ID of its own (no usable ID, or such a repeat) is listed in the summary's
``refused``, by position, naming the field and the limit; so is an item whose ID breaks the request-ID rule
(:data:`~protocol.keys.REQUEST_ID_PATTERN`, as every other face holds it: an ID with a CR/LF, non-ASCII or
over 128 characters names a key no client can poll), which is not run. A message carrying more than
``MAX_BULK_REQUESTS`` runs none of them, and each request it names gets that refusal as its result. An item
whose ID is the message's own task ID is refused too (listed, not run): the message's summary is stored under
that ID, and the item's result would have taken its place (the first stored is kept), its ``refused`` list lost.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any

from protocol.cancel_marks import note_taken_and_read
from protocol.errors import DecodeError, FleetError, IdempotencyConflict, InvalidRequest
from protocol.keys import REQUEST_ID_PATTERN, REQUEST_ID_RULE
from protocol.messages import MAX_BULK_REQUESTS, decode_request
from protocol.request_marker import request_fingerprint
from workers.metrics import outcome_of, queue_wait_ms_of
from workers.pipeline import Prepared, finish, prepare
from workers.runtime import WorkerRuntime
from workers.scheduler import Job, Role

__all__ = ["handle_bulk", "summarize"]


class _Collector:
    """Stands in for a scheduler arrival: collects jobs so they can be submitted together."""

    def __init__(self) -> None:
        self.jobs: list[Job] = []
        self.submitted = True

    def submit(self, job: Job) -> Any:
        self.jobs.append(job)
        return job.future


def _request_ids(items: list[Any]) -> list[str | DecodeError]:
    """Each item's request ID, or why it has none a result could be stored under (that item alone fails:
    its siblings still run and store theirs): a missing one, or one that breaks :data:`REQUEST_ID_PATTERN`."""
    ids: list[str | DecodeError] = []
    for pos, item in enumerate(items):
        rid = item.get("request_id") if isinstance(item, dict) else None
        if not isinstance(rid, str) or not rid:
            ids.append(DecodeError(
                f"requests[{pos}].request_id is required in a bulk message: {REQUEST_ID_RULE}",
                f"requests[{pos}].request_id",
                REQUEST_ID_PATTERN,
            ))
        elif not re.fullmatch(REQUEST_ID_PATTERN, rid):
            shown = ascii(rid[:40]) + ("…" if len(rid) > 40 else "")
            ids.append(DecodeError(
                f"requests[{pos}].request_id {shown} ({len(rid)} characters) must be {REQUEST_ID_RULE}: the ID names "
                "the request's result key and GET /v1/requests/{id}; not run, no result stored",
                f"requests[{pos}].request_id",
                REQUEST_ID_PATTERN,
            ))  # fmt: skip
        else:
            ids.append(rid)
    return ids


_NOT_BODY = ("request_id", "submitted_at_unix_s", "deadline_unix_s")
"""Item fields that do not make two items different requests (as :func:`request_fingerprint` leaves them out)."""


def _body(item: Any) -> str:
    """What makes ``item`` the request it is: its fingerprint, or (an item that does not decode) its JSON less
    the fields of :data:`_NOT_BODY`."""
    try:
        return request_fingerprint(decode_request(item))
    except FleetError:
        rest = {k: v for k, v in item.items() if k not in _NOT_BODY} if isinstance(item, dict) else item
        return json.dumps(rest, sort_keys=True, default=repr)


def _repeats(ids: list[str | DecodeError], items: list[Any]) -> dict[int, int | IdempotencyConflict]:
    """Each later position of an ID the message names more than once: the position of its first item (same
    body: the same request) or the conflict that refuses it (another body). Bodies are compared only for
    repeated IDs: a message without repeats costs one count of its IDs."""
    counts = Counter(rid for rid in ids if isinstance(rid, str))
    first: dict[str, tuple[int, str]] = {}
    out: dict[int, int | IdempotencyConflict] = {}
    for pos, (rid, item) in enumerate(zip(ids, items, strict=True)):
        if not isinstance(rid, str) or counts[rid] < 2:
            continue
        body = _body(item)
        if rid not in first:
            first[rid] = (pos, body)
        elif first[rid][1] == body:
            out[pos] = first[rid][0]
        else:
            out[pos] = IdempotencyConflict(
                f"requests[{pos}]: request_id {rid!r} is already named by requests[{first[rid][0]}] of this message "
                "with a different body; not run (an ID names one request: its result is requests"
                f"[{first[rid][0]}]'s)", f"requests[{pos}].request_id", None)  # fmt: skip
    return out


def _refused(pos: int, rid: str | None, exc: FleetError) -> dict[str, Any]:
    """A summary's entry for the item at ``pos`` whose error is stored under no ID of its own: its position, its
    ID (None when it has no usable one) and the error as the gateway writes one (type, message, field, limit)."""
    return {"index": pos, "request_id": rid, **exc.to_payload()}


def _refuse_all(backend: Any, items: list[Any], error: FleetError) -> FleetError:
    """Store ``error`` (the message itself is refused) as the result of each request ``items`` names, so none
    of them is left without an outcome; returns it, to be raised."""
    named = dict.fromkeys(rid for rid in _request_ids(items) if isinstance(rid, str))
    if named:
        backend.store_many([(rid, "FAILURE", error) for rid in named])
    return error


def handle_bulk(
    runtime: WorkerRuntime, payload: dict[str, Any], *, worker: str, backend: Any, role: Role = "stable",
    task_id: str | None = None,
) -> dict[str, Any]:
    """Serve every request of one bulk message; returns :func:`summarize`'s summary, with ``refused`` (a list of
    :func:`_refused` entries) added when an item's error is stored under no ID of its own.

    ``role``: the role of the queue the message came from (see :func:`workers.pipeline.prepare`); ``task_id``:
    the message's own (its summary's key), which no item may take as its request ID.

    Raises:
        DecodeError / InvalidRequest: the message itself is malformed (no request ran).
    """
    items = payload.get("requests")
    if not isinstance(items, list) or not items:
        raise DecodeError("requests must be a non-empty list", "requests", "non-empty list")
    if len(items) > MAX_BULK_REQUESTS:
        raise _refuse_all(backend, items, InvalidRequest(
            f"a bulk message carries {len(items)} requests; the limit is {MAX_BULK_REQUESTS}: none of them was run",
            "requests",
            MAX_BULK_REQUESTS,
        ))  # fmt: skip
    ids = _request_ids(items)
    prepared, jobs = _prepare_all(runtime, ids, items, role, task_id)
    for _ in ids:
        runtime.token_taken()
    held = _hold(runtime, ids, prepared)
    try:
        runtime.scheduler.submit_many(jobs)
        outcomes, refused = _outcomes(runtime, ids, prepared, worker)
        _store_all(backend, outcomes)
    finally:
        for rid in held:
            runtime.held.release(rid)
        for _ in ids:
            runtime.token_returned()
    summary = summarize(outcomes)
    if refused:
        summary["refused"] = refused
    return summary


_Item = Prepared | FleetError | int
"""An item as prepared: handed to the scheduler, refused (its error), or the position of the earlier item with its
ID and body (the same request: not run again)."""


def _prepare_all(runtime: WorkerRuntime, ids: list[str | DecodeError], items: list[Any], role: Role,
                 task_id: str | None = None) -> tuple[list[_Item], list[Job]]:  # fmt: skip
    """Each item prepared (:func:`workers.pipeline.prepare`, its cancel mark read for all in one MGET), and the
    one-step jobs to submit together."""
    repeats = _repeats(ids, items)
    for pos, rid in enumerate(ids):
        if task_id is not None and rid == task_id:  # its outcome would be stored where the summary goes
            repeats[pos] = IdempotencyConflict(
                f"requests[{pos}].request_id {rid!r} is this bulk message's own task ID, under which its summary is "
                "stored; not run (give the request an ID of its own)", f"requests[{pos}].request_id", None)
    named = list(dict.fromkeys(rid for rid in ids if isinstance(rid, str) and rid != task_id))
    marks = note_taken_and_read(runtime.redis, named, runtime.settings.visibility_timeout_s)
    collector = _Collector()
    prepared: list[_Item] = []
    for pos, (rid, item) in enumerate(zip(ids, items, strict=True)):
        if isinstance(rid, FleetError):
            prepared.append(rid)
        elif pos in repeats:  # the first item's position (not run again), or the conflict that refuses it
            prepared.append(repeats[pos])
        else:
            try:
                prepared.append(prepare(runtime, item, collector, request_id=rid, cancelled=bool(marks[rid]),
                                        role=role))  # fmt: skip
            except FleetError as exc:
                prepared.append(exc)
    return prepared, collector.jobs


def _outcomes(runtime: WorkerRuntime, ids: list[str | DecodeError], prepared: list[_Item],
              worker: str) -> tuple[list[tuple[str | None, str, Any]], list[dict[str, Any]]]:  # fmt: skip
    """Wait for the prepared items; per item ``(ID to store it under or None, state, result or error)``, and the
    :func:`_refused` entries of the errors stored under no ID of their own."""
    outcomes: list[tuple[str | None, str, Any]] = []
    refused: list[dict[str, Any]] = []
    for pos, (rid, prep) in enumerate(zip(ids, prepared, strict=True)):
        if isinstance(prep, int):  # the same request as requests[prep]: its outcome, stored once
            outcomes.append((None, outcomes[prep][1], outcomes[prep][2]))
        elif isinstance(prep, FleetError):
            own = rid if isinstance(rid, str) and not isinstance(prep, IdempotencyConflict) else None
            outcomes.append((own, "FAILURE", prep))
            if own is None:
                refused.append(_refused(pos, rid if isinstance(rid, str) else None, prep))
        else:
            assert isinstance(rid, str)  # an item without a usable ID was prepared as its error
            try:
                outcomes.append((rid, "SUCCESS", finish(runtime, prep, request_id=rid, worker=worker)))
            except Exception as exc:
                outcomes.append((rid, "FAILURE", exc))
    return outcomes, refused


def _hold(runtime: WorkerRuntime, ids: list[str | DecodeError], prepared: list[_Item]) -> list[str]:
    """Count the prepared requests as held (their markers are written back where Redis loses them:
    :mod:`workers.held_requests`); returns their IDs."""
    held: list[str] = []
    for rid, prep in zip(ids, prepared, strict=True):
        if isinstance(rid, str) and isinstance(prep, Prepared):
            runtime.held.hold(rid, prep.request, started_by=None)
            held.append(rid)
    return held


def summarize(outcomes: list[tuple[str | None, str, Any]]) -> dict[str, Any]:
    """The bulk task's return value: counts, counts by metrics ``outcome`` label, and queue waits.

    ``outcomes`` holds ``(request_id or None, "SUCCESS" | "FAILURE", result dict | exception)`` per request.
    ``queue_wait_ms`` lists each succeeded request's producer submit → batch start time (ms), in
    request order; the worker's metrics observe them like ``fleet.infer`` results. An ID repeated with
    another body counts as ``invalid`` (the caller's message is at fault; nothing ran).
    """
    by_outcome: dict[str, int] = {}
    waits: list[float] = []
    for _, state, value in outcomes:
        failed = state == "FAILURE"
        label = "invalid" if isinstance(value, IdempotencyConflict) else outcome_of(value if failed else None)
        by_outcome[label] = by_outcome.get(label, 0) + 1
        wait_ms = None if failed else queue_wait_ms_of(value)
        if wait_ms is not None:
            waits.append(wait_ms)
    succeeded = by_outcome.get("succeeded", 0)
    return {
        "count": len(outcomes),
        "succeeded": succeeded,
        "failed": len(outcomes) - succeeded,
        "outcomes": by_outcome,
        "queue_wait_ms": waits,
    }


def _store_all(backend: Any, outcomes: list[tuple[str | None, str, Any]]) -> None:
    """Write each named request's result as ``fleet.infer``'s are written (Celery's format, by the result
    backend's store script: a stored outcome is never replaced), in one pipeline."""
    backend.store_many([(rid, state, value) for rid, state, value in outcomes if rid is not None])
