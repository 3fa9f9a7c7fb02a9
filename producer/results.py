"""Reading requests back by ID: status, results, waits, token streams and cancels.

:class:`ResultReader` is the half of :class:`producer.client.FleetClient` that never queues
anything; it needs only the client's Celery app, Redis connection and settings.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from enum import StrEnum
from typing import Any

import redis
from celery import Celery

from producer.arguments import checked_request_id, checked_request_ids, poll_interval_s, seconds_limit
from producer.result_waiter import CANCELLED_BEFORE_RUN, ResultWaiter
from producer.streams import MAX_OUTAGE_S, RETRIED, Reconnect, iter_events
from protocol.cancel_marks import MARK_SCRIPT, cancelled_before_run, cancelled_for_good, mark_args, mark_keys
from protocol.errors import (
    FleetError,
    RequestCancelled,
    RequestExpired,
    RequestNotFound,
    ResultTimeout,
    error_from_payload,
)
from protocol.keys import CANCEL_KEY, REQUEST_KEY
from protocol.messages import InferenceResult, decode_result
from protocol.settings import FleetSettings
from protocol.streams import StreamEvent

__all__ = ["CANCEL_SETTLE_S", "RequestStatus", "ResultReader", "as_fleet_error", "status_from", "status_of_error"]


class RequestStatus(StrEnum):
    """Lifecycle of one request as a client sees it."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLED = "cancelled"
    NOT_FOUND = "not_found"


class ResultReader:
    """Status, results, waits, streams and cancels of requests, by ID."""

    app: Celery
    redis: redis.Redis[bytes]
    settings: FleetSettings
    waiter: ResultWaiter
    _mark_script: Any = None
    """:data:`protocol.cancel_marks.MARK_SCRIPT`, registered on :attr:`redis` at the first cancel."""

    # -- status and results ----------------------------------------------------------------------
    def status(self, request_id: str) -> RequestStatus:
        """Where ``request_id`` stands now (one Redis round trip: see :func:`status_from`).

        Raises:
            InvalidRequest: ``request_id`` is not a non-empty string.
        """
        return self._stored(request_id)[1]

    def _stored(self, request_id: str) -> tuple[dict[str, Any] | None, RequestStatus]:
        """``request_id``'s stored Celery meta (None when none) and its status, in one round trip on
        :attr:`redis` (never on Celery's backend, whose client is one per thread: a connection each
        that :meth:`close` cannot reach)."""
        request_id = checked_request_id(request_id)
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.get(self.app.backend.get_key_for_task(request_id))
            pipe.get(CANCEL_KEY.format(id=request_id))
            pipe.exists(REQUEST_KEY.format(id=request_id))
            raw, mark, known = pipe.execute()
        meta = self.app.backend.decode_result(raw) if raw is not None else None
        return meta, status_from(meta, cancel_marked=cancelled_for_good(mark), known=bool(known))

    def result(self, request_id: str, *, wait: bool = False, timeout_s: float | None = None) -> InferenceResult | None:
        """The result of ``request_id``; None if not ready and ``wait`` is False.

        Waiting subscribes to the result's channel (pub/sub wakes the caller the moment the result is
        stored), reads the key once, and always unsubscribes before returning
        (:class:`producer.result_waiter.ResultWaiter`; Celery's ``AsyncResult.get`` speaks the same
        protocol at several times the CPU).

        Raises:
            FleetError: the request failed (the worker's error, rebuilt: InputTooLong, RequestExpired, …).
            ResultTimeout: ``wait`` and no result within ``timeout_s`` (None or ``inf``: wait without limit).
            RequestNotFound: not waiting, and the ID was never submitted or its result expired.
            RequestCancelled: it was cancelled before it ran (stored by the worker that dropped it, or only
                marked: no worker took it yet), waiting or not.
            InvalidRequest: ``request_id`` is not a non-empty string, or ``timeout_s`` is not a number of
                seconds >= 0 (NaN, negative).
        """
        request_id = checked_request_id(request_id)
        limit_s = seconds_limit(timeout_s, "timeout_s")
        if not wait:
            finished = self._finished([request_id])
            if request_id in finished:
                return self._raise_or_return(finished[request_id])
            status = self.status(request_id)
            if status is RequestStatus.CANCELLED:  # cancelled while queued: no worker may ever store why
                raise RequestCancelled.before_run(request_id)
            if status is RequestStatus.NOT_FOUND:
                raise RequestNotFound(f"no request {request_id!r} is known", "request_id", None)
            return None
        backend = self.app.backend  # the waiter reads the cancel mark with the key, in the same round trip:
        meta = self.waiter.wait(backend.get_key_for_task(request_id), limit_s,  # a request cancelled while
                                cancel_mark=CANCEL_KEY.format(id=request_id))  # queued ends the wait at once
        if meta is CANCELLED_BEFORE_RUN:
            raise RequestCancelled.before_run(request_id)
        if meta is None:
            raise ResultTimeout(f"no result for {request_id} within {timeout_s} s", "timeout_s", timeout_s)
        outcome = self.outcome_of(request_id, meta)
        if outcome is None:  # pragma: no cover - the waiter returns ready states only
            raise FleetError(f"request {request_id} ended in state {meta.get('status')}", "request_id", None)
        return self._raise_or_return(outcome)

    @staticmethod
    def _raise_or_return(outcome: InferenceResult | FleetError) -> InferenceResult:
        if isinstance(outcome, FleetError):
            raise outcome
        return outcome

    def wait(
        self, request_ids: Iterable[str], timeout_s: float | None = 60.0, *, poll_s: float = 0.005
    ) -> list[InferenceResult | FleetError]:
        """Results (or errors) of many requests, in order, waiting up to ``timeout_s`` overall (None or
        ``inf``: without limit, as :meth:`result`).

        Polls the result keys with MGET (one round trip per poll for up to 1,000 IDs), backing off
        from ``poll_s`` (s, > 0) to 100 ms; a request still unfinished at the deadline gets ``ResultTimeout``, one
        cancelled while queued ``RequestCancelled`` as soon as its cancel is written (see :meth:`_finished`).
        ``request_ids`` is read once (a generator is fine). While Redis does not answer (a restart, a blip),
        the MGET is tried again as :func:`producer.streams.iter_events` reads (:data:`producer.streams.RETRIED`,
        waits from 50 ms doubling to 1 s) until the deadline, or for :data:`producer.streams.MAX_OUTAGE_S`
        when there is none.

        Raises:
            InvalidRequest: an ID is not a non-empty string (named ``request_ids[i]``), ``timeout_s`` is NaN,
                negative or not a number, or ``poll_s`` is not a finite number > 0.
            redis.ConnectionError, redis.TimeoutError: Redis still did not answer at the deadline (or for
                ``MAX_OUTAGE_S`` without one).
        """
        ids = checked_request_ids(request_ids)
        limit_s = seconds_limit(timeout_s, "timeout_s")
        pause_s = poll_interval_s(poll_s)
        deadline = None if limit_s is None else time.monotonic() + limit_s
        retry = Reconnect(MAX_OUTAGE_S if limit_s is None else limit_s)
        done: dict[str, InferenceResult | FleetError] = {}
        remaining = list(dict.fromkeys(ids))
        while remaining:
            try:
                done.update(self._finished(remaining))
                retry.answered()
            except RETRIED as exc:
                time.sleep(_outage_wait_s(retry, exc, deadline))
                continue
            remaining = [rid for rid in remaining if rid not in done]
            now = time.monotonic()
            if remaining and deadline is not None and now >= deadline:
                for rid in remaining:
                    done[rid] = ResultTimeout(f"no result for {rid} within {timeout_s} s", "timeout_s", timeout_s)
                break
            if remaining:
                time.sleep(pause_s if deadline is None else min(pause_s, deadline - now))
                pause_s = min(0.1, pause_s * 1.5)
        return [done[rid] for rid in ids]

    def _finished(self, request_ids: Sequence[str]) -> dict[str, InferenceResult | FleetError]:
        """The finished ones among ``request_ids``: one MGET of their stored results and their cancel marks per
        1,000 IDs. A request cancelled while queued is finished (``RequestCancelled``) the moment its mark is
        written (:func:`protocol.cancel_marks.cancelled_before_run`), not when a worker takes it off the queue."""
        backend = self.app.backend
        finished: dict[str, InferenceResult | FleetError] = {}
        for start in range(0, len(request_ids), 1000):
            chunk = request_ids[start : start + 1000]
            values = self.redis.mget([backend.get_key_for_task(rid) for rid in chunk]
                                     + [CANCEL_KEY.format(id=rid) for rid in chunk])  # fmt: skip
            raws, marks = values[: len(chunk)], values[len(chunk) :]
            for rid, raw, mark in zip(chunk, raws, marks, strict=True):
                outcome = self.outcome_stored(rid, raw, mark)
                if outcome is not None:
                    finished[rid] = outcome
        return finished

    def outcome_stored(self, request_id: str, raw_meta: bytes | None,
                       mark: bytes | None) -> InferenceResult | FleetError | None:  # fmt: skip
        """A request's result or error from the values of its result key (``raw_meta``, None: nothing stored) and
        of its cancel mark (None: none), read together: ``RequestCancelled`` for one cancelled while queued
        (:func:`protocol.cancel_marks.cancelled_before_run`), else :meth:`outcome_of` its meta; None while it has
        none. Every face reads stored outcomes through this, so each reports the same one."""
        if cancelled_before_run(raw_meta, mark):
            return RequestCancelled.before_run(request_id)
        return None if raw_meta is None else self.outcome_of(request_id, self.app.backend.decode_result(raw_meta))

    def outcome_of(self, request_id: str, meta: dict[str, Any]) -> InferenceResult | FleetError | None:
        """A finished request's result or error from its stored Celery meta; None while not finished."""
        state = meta.get("status")
        if state == "SUCCESS":
            return decode_result(meta["result"])
        if state == "FAILURE":
            return as_fleet_error(meta["result"])
        if state == "REVOKED":
            return RequestCancelled(f"request {request_id} was cancelled", "request_id", None)
        return None

    def cancel(self, request_id: str, *, settle_s: float = 0.0) -> bool:
        """Cancel a request that has not run, or a generation that runs; False when that is too late.

        A running generation stops within one decode step and ends with ``finish_reason``
        ``cancelled`` (its tokens so far are its result); a running one-step request cannot be stopped.
        ``settle_s`` > 0 returns only once such a generation has stored its result (or ``settle_s``
        seconds passed), so that a status read next says how it ended, not ``running``.

        The cancel is a mark in Redis (``fleet:cancel:<id>``, announced on ``fleet:cancels``) that the
        worker taking the request reads; no Celery revoke is broadcast, so cancels from many threads
        at once each cost two Redis round trips and hold no broker connection. With
        A one-step request a worker already took gets the answer True: while it waits in the worker's batch
        window, the worker hears the announcement and takes it out unrun, and it ends cancelled
        (``RequestCancelled``, as one cancelled in the queue) while the requests beside it run; once its
        batch has started, its result, stored next, wins (an engine step is not stopped part way). With
        ``settle_s`` > 0 the answer for such a request waits for its outcome and is False where its result
        won. ``celery.track_started`` (a held one-step request then reads running) changes none of this.

        Raises:
            RequestNotFound: no request of that ID is known (never submitted through the fleet, or its
                result expired), as ``DELETE /v1/requests/{id}`` answers 404 and ``fleet cancel`` exits 1;
                before, the cancel mark it set refused a request later sent under that ID, for an hour.
            InvalidRequest: ``request_id`` is not a non-empty string.
        """
        request_id = checked_request_id(request_id)
        meta, status = self._stored(request_id)
        if status is RequestStatus.NOT_FOUND:
            raise RequestNotFound(f"no request {request_id!r} is known: never submitted through the fleet, or its "
                                  "result expired (result_ttl_s)", "request_id", None)  # fmt: skip
        state = meta.get("status") if meta else None
        if state in ("SUCCESS", "FAILURE", "REVOKED"):
            return bool(state == "REVOKED")
        held = self._mark_cancelled(request_id)
        if state == "STARTED" or held:  # a worker holds it: it drops it unrun, or its result wins
            if settle_s <= 0:
                return True
            outcome = self.wait([request_id], timeout_s=settle_s)[0]  # a ResultTimeout: still held, said next
            generation = self._kind_of(request_id) == "generate"
            return generation or not isinstance(outcome, InferenceResult)  # a one-step result: its batch had run
        return True

    def _mark_cancelled(self, request_id: str) -> bool:
        """The cancel mark (read by the worker that dequeues it) and its announcement to running ones, in one
        script run (:mod:`protocol.cancel_marks`); True when a worker had taken the request (the cancel is
        asked of it: the request ends with what it stores), False when the cancel is for good.

        The mark is the cancel: a worker reads it in the round trip that takes the message
        (broker.cancel_marks) and refuses the request; a worker that took it before hears the announcement
        and drops it if it still waits for its batch (workers.cancel_watch). No Celery revoke is sent: a
        taken request starts at once (prefetch 1, threads pool), so a revoke never finds one waiting in a
        worker, it does not stop a running one (no terminate on threads), a bulk message carries other IDs,
        and its broadcast takes two connections of the app's pool per call: 10 concurrent cancels
        deadlocked on it."""
        script = self._mark_script
        if script is None or script.registered_client is not self.redis:
            script = self._mark_script = self.redis.register_script(MARK_SCRIPT)
        return bool(script(keys=mark_keys(request_id), args=mark_args(request_id, self.settings.result_ttl_s)))

    def _kind_of(self, request_id: str) -> str | None:
        """The output kind recorded at submit (None for requests queued by other clients)."""
        raw = self.redis.get(REQUEST_KEY.format(id=request_id))
        try:
            kind = json.loads(raw).get("kind") if raw else None
        except (ValueError, AttributeError):
            return None
        return str(kind) if kind else None

    def stream(self, request_id: str, *, timeout_s: float | None = 60.0) -> Iterator[StreamEvent]:
        """The token events of generation ``request_id`` as they are produced (see :mod:`producer.streams`).

        Each token index comes once, even across a redelivery; the last event is ``final`` (finish
        reason, usage) or ``error``. Works before the worker starts it and after it finished
        (the stream lives ``result_ttl_s``). A stream that stopped short of its end (events lost
        in a Redis restart) ends from the stored result once there is one: same indexes, same text.
        While Redis does not answer, the reader tries again for up to 30 s.

        Raises:
            ResultTimeout: no event for ``timeout_s`` seconds (None or ``inf``: no limit).
            redis.ConnectionError: Redis did not answer for 30 s, or until ``timeout_s`` of silence ran out.
            InvalidRequest: ``request_id`` is not a non-empty string, or ``timeout_s`` is NaN, not > 0 or not
                a number (raised here, before the first event is asked for).
        """
        request_id = checked_request_id(request_id)
        limit_s = seconds_limit(timeout_s, "timeout_s", positive=True)
        return iter_events(
            self.redis, request_id, timeout_s=math.inf if limit_s is None else limit_s,
            outcome=lambda: self._finished([request_id]).get(request_id),
        )  # fmt: skip


def _outage_wait_s(retry: Reconnect, exc: Exception, deadline: float | None) -> float:
    """How long to wait before asking Redis again after ``exc``; raises ``exc`` once the deadline (or the
    outage bound of ``retry``) has passed."""
    now = time.monotonic()
    wait_s = retry.failed(now)
    if wait_s is None or (deadline is not None and now >= deadline):
        raise exc
    return wait_s if deadline is None else min(wait_s, deadline - now)


def as_fleet_error(value: Any) -> FleetError:
    """A stored failure (the exception Celery rebuilt, or its JSON form) as the fleet's error."""
    if isinstance(value, FleetError):
        return value
    if isinstance(value, BaseException):
        return error_from_payload(type(value).__name__, value.args)
    if isinstance(value, dict) and "exc_type" in value:
        return error_from_payload(str(value["exc_type"]), value.get("exc_message", ()))
    return FleetError(str(value), None, None)


def status_of_error(err: FleetError) -> RequestStatus:
    """The status a request that ended with ``err`` has: expired, cancelled, or failed."""
    if isinstance(err, RequestExpired):
        return RequestStatus.EXPIRED
    if isinstance(err, RequestCancelled):
        return RequestStatus.CANCELLED
    return RequestStatus.FAILED


CANCEL_SETTLE_S = 5.0
"""How long ``fleet cancel`` and ``DELETE /v1/requests/{id}`` wait for a running generation to stop before
they answer (s); it stops within one decode step."""


def status_from(meta: Mapping[str, Any] | None, *, cancel_marked: bool, known: bool) -> RequestStatus:
    """A request's status from what Redis holds of it: its stored Celery ``meta`` (decoded; None when no
    state is stored), whether it carries a cancel mark, and whether its submit marker exists.

    A stored outcome wins (SUCCESS, REVOKED, FAILURE: an expiry or a cancel among failures is said as such);
    then a cancel for good (``cancel_marked``: :func:`protocol.cancel_marks.cancelled_for_good`); then STARTED
    (running); then the marker (queued); else the ID is unknown.
    """
    state = meta.get("status") if meta else None
    if state == "SUCCESS":
        return RequestStatus.SUCCEEDED
    if state == "REVOKED":
        return RequestStatus.CANCELLED
    if state == "FAILURE":
        return status_of_error(as_fleet_error(meta.get("result") if meta else None))
    if cancel_marked:  # for good: the worker that stored STARTED (before it read the mark) drops it unrun
        return RequestStatus.CANCELLED
    if state == "STARTED":
        return RequestStatus.RUNNING
    if known:
        return RequestStatus.QUEUED
    return RequestStatus.NOT_FOUND
