"""Wait for stored results on the event loop: read ``celery-task-meta-<id>`` with ``MGET`` on
``redis.asyncio``, woken by the result's publication (:mod:`gateway.result_notifier`) or, without a
notifier, polling from :data:`FIRST_POLL_S` to :data:`MAX_POLL_S`, so a waiting HTTP request costs a
coroutine, never a thread.

A wait for a model no live worker serves is bounded: past ``no_worker_after_s`` the workers' heartbeats
(:mod:`producer.presence`, what ``/readyz`` reads) are checked every :data:`NO_WORKER_RECHECK_S`, and
the wait ends with :class:`~protocol.errors.NoLiveWorker` naming the model while none is live.

A request cancelled while queued ends its waits at once with ``RequestCancelled``: each read of the result keys
reads their cancel marks in the same ``MGET``, and the cancel publishes a wake-up on the result's channel
(:func:`protocol.cancel_marks.cancel_wake`), a publication that is no outcome and so makes the wait read."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

import redis.asyncio

from gateway.cancelling import cancel_and_wait
from gateway.event_waits import set_within
from gateway.result_notifier import ResultNotifier, Watch
from producer.client import FleetClient
from producer.presence import AsyncWorkerPresence, no_worker_message
from protocol.errors import FleetError, NoLiveWorker, ResultTimeout
from protocol.keys import CANCEL_KEY
from protocol.messages import InferenceResult
from protocol.streams import StreamEvent

__all__ = ["FIRST_POLL_S", "MAX_POLL_S", "NO_WORKER_RECHECK_S", "WAIT_S", "await_outcomes", "await_watched",
           "relay_unless_no_worker"]

WAIT_S = 600.0
"""Longest wait of a gateway call for a result, and longest silence of a stream it relays (s); the
OpenAI SDKs give up after 600 s too. Past it: 504 (or an error event) naming the ID to poll."""

NO_WORKER_RECHECK_S = 1.0
"""How often a wait past its no-worker bound reads the heartbeats again (s): a SCAN, so not every poll."""

FIRST_POLL_S = 0.005
MAX_POLL_S = 0.1
BACKSTOP_POLL_S = (0.25, 1.0)
"""First and longest pause between two reads of a wait that a publication wakes (s): what bounds the
delay when a publication is lost."""
Outcome = InferenceResult | FleetError
Item = TypeVar("Item", StreamEvent, list[StreamEvent])
"""What a relay hands on: one event, or the events one read brought."""


async def relay_unless_no_worker(
    events: AsyncIterator[Item], fleet: FleetClient, presence: AsyncWorkerPresence, model: str, *,
    wait_s: float,
) -> AsyncIterator[Item]:
    """``events`` as they come; but while none has come and no live worker of ``model`` is seen (checked
    every :data:`NO_WORKER_RECHECK_S`), the silence ends after ``wait_s`` with NoLiveWorker.

    Raises:
        NoLiveWorker: no event and no live worker for ``wait_s``.
    """
    it = events.__aiter__()
    started = time.monotonic()
    watching = not await presence.has_worker(model)  # a worker is seen, or an event came: no bound
    step: asyncio.Future[Item] | None = None
    try:
        if watching:  # the first item, read beside the heartbeat checks
            step = asyncio.ensure_future(it.__anext__())
            while watching:
                done, _ = await asyncio.wait({step}, timeout=NO_WORKER_RECHECK_S)
                if done or await presence.has_worker(model):
                    watching = False
                elif time.monotonic() - started >= wait_s:
                    waited = f"; none appeared in {time.monotonic() - started:.0f} s"
                    raise NoLiveWorker(no_worker_message(model, fleet.settings.queue_for(model)) + waited,
                                       "model", model)
            try:
                first = await step
            except StopAsyncIteration:
                return
            yield first
        async for item in it:  # unbounded from here: read directly, no task per item
            yield item
    finally:  # the relay's pending read ends before the relay closes (it cannot close while it runs)
        if step is not None and not step.done():
            await cancel_and_wait(step)  # again while it goes on: a cancel can be swallowed (gateway.cancelling)
        closing = getattr(it, "aclose", None)
        if closing is not None:
            await closing()


async def await_outcomes(
    fleet: FleetClient, aredis: redis.asyncio.Redis[bytes], request_ids: Sequence[str], *, timeout_s: float,
    model: str | None = None, no_worker_after_s: float | None = None, presence: AsyncWorkerPresence | None = None,
    notifier: ResultNotifier | None = None,
) -> dict[str, Outcome]:
    """The result (or the error) of every one of ``request_ids``, once all are stored.

    ``notifier`` (the process's :class:`~gateway.result_notifier.ResultNotifier`): woken the moment a
    result is published, reading the keys only on a slow backstop schedule; without it, polled.

    ``model``, ``no_worker_after_s`` and ``presence`` (the process's shared heartbeat reader): from that many
    seconds on, the wait ends as soon as no live worker of ``model`` is seen (checked every
    :data:`NO_WORKER_RECHECK_S`).

    Raises:
        ResultTimeout: some are still unfinished after ``timeout_s``; names the first of them.
        NoLiveWorker: past ``no_worker_after_s``, no live worker serves ``model``.
    """
    if notifier is None:
        return await _read_until_done(fleet, aredis, request_ids, None, timeout_s, model, no_worker_after_s, presence)
    keys = [fleet.app.backend.get_key_for_task(rid) for rid in dict.fromkeys(request_ids)]
    async with notifier.watching(keys) as watch:  # subscribed before the first read: no result slips between
        return await _read_until_done(fleet, aredis, request_ids, watch, timeout_s, model, no_worker_after_s,
                                      presence)  # fmt: skip


async def await_watched(
    fleet: FleetClient, aredis: redis.asyncio.Redis[bytes], request_ids: Sequence[str], watch: Watch, *,
    timeout_s: float,
) -> dict[str, Outcome]:
    """:func:`await_outcomes` for a caller that subscribed ``watch`` (:meth:`ResultNotifier.watching`) and
    then read the result keys itself, finding them unfinished: no first read, the next comes from a
    publication or the backstop.

    Raises:
        ResultTimeout: some are still unfinished after ``timeout_s``; names the first of them.
    """
    return await _read_until_done(fleet, aredis, request_ids, watch, timeout_s, None, None, None, read_first=False)


async def _read_until_done(
    fleet: FleetClient, aredis: redis.asyncio.Redis[bytes], request_ids: Sequence[str], watch: Watch | None,
    timeout_s: float, model: str | None, no_worker_after_s: float | None, presence: AsyncWorkerPresence | None,
    *, read_first: bool = True,
) -> dict[str, Outcome]:
    """:func:`await_outcomes`' loop: read the result keys, then wait for ``watch`` (a result published) or
    the next read of the backstop schedule (``BACKSTOP_POLL_S``, or without ``watch`` the polling one).
    A publication carries the stored value: woken by one, the wait takes it from ``watch.published`` and
    reads Redis again only when the backstop's time comes. ``read_first`` False (a subscribed ``watch``
    whose keys the caller read after subscribing): the first pass takes only what was published."""
    backend = fleet.app.backend
    started = time.monotonic()
    deadline = started + timeout_s
    check_at = None if model is None or no_worker_after_s is None or presence is None else started + no_worker_after_s
    poll_s, max_poll_s = (FIRST_POLL_S, MAX_POLL_S) if watch is None else BACKSTOP_POLL_S
    done: dict[str, Outcome] = {}
    remaining = list(dict.fromkeys(request_ids))
    read = read_first or watch is None  # a result stored before the subscription was never published to it
    while True:
        if watch is not None:
            watch.event.clear()  # before the read: a result stored after it sets the event again
        stored = await _stored_values(aredis, [backend.get_key_for_task(rid) for rid in remaining],
                                      [CANCEL_KEY.format(id=rid) for rid in remaining], watch, read)  # fmt: skip
        settled, woken_unsettled = _settled(fleet, remaining, stored, published=not read)
        done.update(settled)
        remaining = [rid for rid in remaining if rid not in done]
        if not remaining:
            return done
        if woken_unsettled:  # a publication that is no outcome (a cancel's wake-up, a STARTED): read at once
            read = True
            continue
        now = time.monotonic()
        if check_at is not None and model is not None and presence is not None and now >= check_at:
            if not await presence.has_worker(model):
                waited = f"; none appeared in {now - started:.0f} s"
                raise NoLiveWorker(no_worker_message(model, fleet.settings.queue_for(model)) + waited, "model", model)
            check_at = now + NO_WORKER_RECHECK_S
        if now >= deadline:
            msg = f"no result for {remaining[0]} within {timeout_s} s; poll GET /v1/requests/{remaining[0]}"
            raise ResultTimeout(msg, "timeout_s", timeout_s)
        pause = min(poll_s, max(0.0, deadline - now))
        if check_at is not None:
            pause = min(pause, max(0.0, check_at - now))
        read = await _pause(watch, pause)
        poll_s = min(max_poll_s, poll_s * 1.5)


def _settled(fleet: FleetClient, request_ids: list[str], stored: list[tuple[bytes | None, bytes | None]], *,
             published: bool) -> tuple[dict[str, Outcome], bool]:  # fmt: skip
    """The outcomes among ``stored`` (each request's result value and cancel mark, :func:`_stored_values`), read
    as the client reads them so that every face reports the same outcome; and, for ``published`` values, whether
    one came that is no outcome (a cancel's wake-up, a STARTED): the wait then reads Redis at once."""
    done: dict[str, Outcome] = {}
    woken_unsettled = False
    for rid, (raw, mark) in zip(request_ids, stored, strict=True):
        outcome = fleet.outcome_stored(rid, raw, mark)  # a publication carries no mark (None): its value alone
        if outcome is not None:
            done[rid] = outcome
        woken_unsettled = woken_unsettled or (published and raw is not None and outcome is None)
    return done, woken_unsettled


async def _stored_values(aredis: redis.asyncio.Redis[bytes], keys: list[bytes], marks: list[str], watch: Watch | None,
                         read: bool) -> list[tuple[bytes | None, bytes | None]]:  # fmt: skip
    """The value of each result key and of its request's cancel mark: both read from Redis in one MGET, or
    (``read`` False: woken by a publication) what was published on the key since, with no mark (None); a key
    without a publication is read at the backstop's time."""
    if read or watch is None:
        values = list(await aredis.mget(keys + marks))  # type: ignore[operator]
        return list(zip(values[: len(keys)], values[len(keys) :], strict=True))
    return [(watch.published.pop(key, None), None) for key in keys]


async def _pause(watch: Watch | None, pause_s: float) -> bool:
    """Wait ``pause_s`` s, or less when a publication wakes ``watch``; whether the next pass must read Redis
    (True unless a publication came)."""
    if watch is None:
        await asyncio.sleep(pause_s)
        return True
    return not await set_within(watch.event, pause_s)  # no publication came: the backstop's read
