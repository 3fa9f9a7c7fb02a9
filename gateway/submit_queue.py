"""The gateway's submissions, grouped while the previous Redis step is in flight (group commit).

Every ``POST /v1/requests`` without a caller-given ID, ``POST /v1/embeddings``, ``/v1/completions`` and
``/v1/chat/completions`` waits here instead of taking a thread of its own. One
flusher at a time takes everything waiting (up to ``api.max_grouped_requests`` requests), admits and
queues it in one thread call (:func:`producer.submit_groups.send_group`), and answers each caller;
what arrives meanwhile is the next group. A lone caller's request is sent at once as an ordinary
``fleet.infer`` task (no window is waited for); under load, one ``fleet.infer_bulk`` message carries a
group's one-step requests, so the broker, the worker's take and the ack are paid once per group, and its
generations go out in the same Redis step, a task each (:mod:`producer.submit_groups`).

With auth on, each request's owner mark (:mod:`gateway.request_owners`: the key whose rate bucket the item is
charged to) is claimed for the whole group in one Redis step before the group is queued, and released for an
item that was then refused.

Metrics: ``fleet_gateway_submit_groups_total`` (Redis steps) and
``fleet_gateway_grouped_requests_total`` (requests they queued); their ratio is the mean group size.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter
from starlette.concurrency import run_in_threadpool

from gateway.request_owners import RequestOwners, carried, taken
from producer.bulk_submit import REDIS_FAILURES
from producer.submit_groups import SubmitItem
from producer.task_writer import owners_in_messages

__all__ = ["SubmitQueue"]

log = logging.getLogger("fleet.api")

SendGroup = Callable[[Sequence[SubmitItem]], list[list[str] | BaseException]]


class SubmitQueue:
    """Collects submissions on the event loop and sends them a group at a time (see the module docstring)."""

    def __init__(self, send_group: SendGroup, *, max_group_requests: int, registry: CollectorRegistry,
                 owners: RequestOwners | None = None) -> None:  # fmt: skip
        """``send_group``: blocking, run in a thread; ``max_group_requests``: most requests per group
        (an item is never split, so a group holds at least one item); ``owners``: where each request's owner
        mark is claimed before its group is queued (None: none are)."""
        self.send_group = send_group
        self.owners = owners
        self.max_group_requests = max_group_requests
        self._waiting: list[tuple[SubmitItem, asyncio.Future[list[str]]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self.groups = Counter("fleet_gateway_submit_groups", "Redis steps that queued grouped submissions.",
                              registry=registry)  # fmt: skip
        self.grouped = Counter("fleet_gateway_grouped_requests",
                               "Requests queued through grouped submissions (÷ groups = mean group size).",
                               registry=registry)  # fmt: skip

    async def submit(self, item: SubmitItem) -> list[str]:
        """Queue ``item``'s requests (all or none); their IDs, in order.

        Raises:
            Whatever refused the item (QueueFull, RateLimited, UnknownModel, a Redis error).
        """
        future: asyncio.Future[list[str]] = asyncio.get_running_loop().create_future()
        self._waiting.append((item, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush(), name="fleet-submit-flusher")
        return await future  # a caller that leaves cancels its wait, never its group's send

    def _take_group(self) -> list[tuple[SubmitItem, asyncio.Future[list[str]]]]:
        group: list[tuple[SubmitItem, asyncio.Future[list[str]]]] = []
        size = 0
        while self._waiting:
            count = len(self._waiting[0][0].requests)
            if group and size + count > self.max_group_requests:
                break
            group.append(self._waiting.pop(0))
            size += count
        return group

    async def _flush(self) -> None:
        while self._waiting:
            group = self._take_group()
            items = [item for item, _ in group]
            try:
                outcomes = await run_in_threadpool(self._send_owned, items)
            except Exception as exc:  # send_group answers per item; this is a bug or a thread-pool failure
                log.exception("grouped submit of %d items failed", len(items))
                outcomes = [exc] * len(items)
            self.groups.inc()
            for (item, future), outcome in zip(group, outcomes, strict=True):
                if isinstance(outcome, BaseException):
                    if not future.done():
                        future.set_exception(outcome)
                    continue
                self.grouped.inc(len(item.requests))
                if not future.done():
                    future.set_result(outcome)

    def _send_owned(self, items: Sequence[SubmitItem]) -> list[list[str] | BaseException]:
        """``send_group`` after claiming every request's owner mark (blocking: in a thread). An item holding an
        ID another key's mark names is refused alone (:func:`gateway.request_owners.taken`); the marks of an
        item refused after its claim are released, except after a Redis failure (queued or not is unknown)."""
        owners = self.owners
        if owners is None:
            return self.send_group(items)
        for item in items:  # IDs made here, not in send_group, so that their marks come first
            item.requests = [r if r.request_id else r.model_copy(update={"request_id": uuid.uuid4().hex})
                             for r in item.requests]  # fmt: skip
        places = [(n, str(r.request_id)) for n, item in enumerate(items) for r in item.requests]
        ids = [rid for _, rid in places]
        marks = [owners.owner_for(items[n].rate_key) for n, _ in places]
        try:
            claimed, held = owners.claim_each(ids, marks)
        except REDIS_FAILURES as exc:
            return [exc] * len(items)
        refused = {places[i][0]: taken(ids[i]) for i in reversed(held)}  # an item's first such ID names it
        sendable = [n for n in range(len(items)) if n not in refused]
        with owners_in_messages(carried(ids, marks), [ids[i] for i in claimed]):  # a worker writes back a lost mark
            sent = dict(zip(sendable, self.send_group([items[n] for n in sendable]) if sendable else [], strict=True))
        outcomes = [refused[n] if n in refused else sent[n] for n in range(len(items))]
        unqueued = {n for n, outcome in enumerate(outcomes)
                    if isinstance(outcome, BaseException) and not isinstance(outcome, REDIS_FAILURES)}  # fmt: skip
        owners.release(ids, marks, [i for i in claimed if places[i][0] in unqueued])
        return outcomes
