"""``fleet.infer_bulk``: many requests in one Celery message, one result per request ID.

One Celery task per request costs a few CPU-milliseconds of broker and result-backend work per
request; producers that need more requests/s send up to ``MAX_BULK_REQUESTS`` requests per message.
The worker validates each request on its own (a bad one fails alone), hands all valid ones to the
scheduler at once, and writes every result under its own ``celery-task-meta-<request_id>`` key in
one Redis pipeline, in Celery's own format, so ``AsyncResult(request_id)``, ``FleetClient.result``
and the HTTP gateway read them like any other result. Flower shows the bulk task, not each request.
"""

from __future__ import annotations

from typing import Any

from protocol.errors import DecodeError, FleetError, InvalidRequest
from protocol.keys import CANCEL_KEY, utf8_text
from protocol.messages import MAX_BULK_REQUESTS
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
    its siblings still run and store theirs)."""
    ids: list[str | DecodeError] = []
    for pos, item in enumerate(items):
        rid = item.get("request_id") if isinstance(item, dict) else None
        if not isinstance(rid, str) or not rid or not utf8_text(rid):
            ids.append(DecodeError(
                f"requests[{pos}].request_id is required in a bulk message: a non-empty UTF-8 string",
                f"requests[{pos}].request_id",
                "non-empty string",
            ))
        else:
            ids.append(rid)
    return ids


def handle_bulk(
    runtime: WorkerRuntime, payload: dict[str, Any], *, worker: str, backend: Any, role: Role = "stable"
) -> dict[str, Any]:
    """Serve every request of one bulk message; returns :func:`summarize`'s summary.

    ``role``: the role of the queue the message came from (see :func:`workers.pipeline.prepare`).

    Raises:
        DecodeError / InvalidRequest: the message itself is malformed (no request ran).
    """
    items = payload.get("requests")
    if not isinstance(items, list) or not items:
        raise DecodeError("requests must be a non-empty list", "requests", "non-empty list")
    if len(items) > MAX_BULK_REQUESTS:
        raise InvalidRequest(
            f"a bulk message carries {len(items)} requests; the limit is {MAX_BULK_REQUESTS}",
            "requests",
            MAX_BULK_REQUESTS,
        )
    ids = _request_ids(items)
    named = [rid for rid in ids if isinstance(rid, str)]
    marks = dict(zip(named, runtime.redis.mget([CANCEL_KEY.format(id=rid) for rid in named]), strict=True))
    collector = _Collector()
    prepared: list[Prepared | FleetError] = []
    for rid, item in zip(ids, items, strict=True):
        if isinstance(rid, FleetError):
            prepared.append(rid)
            continue
        try:
            prepared.append(prepare(runtime, item, collector, request_id=rid, cancelled=bool(marks[rid]), role=role))
        except FleetError as exc:
            prepared.append(exc)
    for _ in ids:
        runtime.token_taken()
    held = _hold(runtime, ids, prepared)
    try:
        runtime.scheduler.submit_many(collector.jobs)
        outcomes: list[tuple[str | None, str, Any]] = []
        for rid, prep in zip(ids, prepared, strict=True):
            if isinstance(prep, FleetError):
                outcomes.append((rid if isinstance(rid, str) else None, "FAILURE", prep))
                continue
            assert isinstance(rid, str)  # an item without a usable ID was prepared as its error
            try:
                outcomes.append((rid, "SUCCESS", finish(runtime, prep, request_id=rid, worker=worker)))
            except Exception as exc:
                outcomes.append((rid, "FAILURE", exc))
        _store_all(backend, outcomes)
    finally:
        for rid in held:
            runtime.held.release(rid)
        for _ in ids:
            runtime.token_returned()
    return summarize(outcomes)


def _hold(runtime: WorkerRuntime, ids: list[str | DecodeError], prepared: list[Prepared | FleetError]) -> list[str]:
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
    request order; the worker's metrics observe them like ``fleet.infer`` results.
    """
    by_outcome: dict[str, int] = {}
    waits: list[float] = []
    for _, state, value in outcomes:
        failed = state == "FAILURE"
        label = outcome_of(value if failed else None)
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
