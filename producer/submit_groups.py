"""Queueing what many callers submitted at about the same time as few Celery messages as possible.

A front end that serves many callers (the HTTP gateway) collects the submissions that arrive while its
previous Redis step is in flight and hands them here together (:class:`SubmitItem` per caller's call).
Each item keeps what a lone ``FleetClient.send`` / ``send_batch`` would give it:

* admission is the item's own: its model's queue cap and its caller's rate bucket, for its requests
  together (``QueueFull`` / ``RateLimited`` go to that item alone, nothing of it queued);
* every request keeps its own ID, marker, result key, cancel mark and status;
* an item's requests are queued all or none.

What changes is the message: the admitted one-step requests of one model travel as one
``fleet.infer_bulk`` message per queue (canary split kept: :func:`producer.bulk_submit.queue_bulk_chunk`),
so the broker, the worker's take and the ack are paid once per group, not per request. A group that
holds a single request is sent as an ordinary ``fleet.infer`` task (so a lightly loaded fleet shows one
task per request in Flower; under load Flower shows the bulk messages). Generations of a group are
queued in one Redis step too, but as one ``fleet.infer`` task each (:meth:`FleetClient.send_batch`): a
generation streams and holds its sequence for many steps, and prefix-aware routing picks its worker by
its prompt; queued together, a burst of them reaches a worker together and starts in one step (sent one
by one from the gateway's threads, they arrived over tens of milliseconds and the first ones started
alone). The gateway sends requests with a caller-given ID one ``FleetClient.send`` each.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from producer.bulk_submit import REDIS_FAILURES, interrupted, queue_bulk_chunk
from protocol.messages import MAX_BULK_REQUESTS, InferenceRequest

if TYPE_CHECKING:
    from producer.client import FleetClient

__all__ = ["SubmitItem", "generates", "send_group"]


@dataclass
class SubmitItem:
    """One caller's submission: built requests of one model, queued all or none."""

    requests: list[InferenceRequest]
    rate_key: str | None = None
    routing_keys: list[str | None] = field(default_factory=list)
    """Per request (canary stickiness); empty = the request IDs."""


def generates(request: InferenceRequest) -> bool:
    """True for a generation (queued as a task of its own, never in a bulk message)."""
    output = request.output
    return output is not None and (output.kind == "generate" or (output.kind is None and bool(output.generation)))


def send_group(client: FleetClient, items: Sequence[SubmitItem]) -> list[list[str] | BaseException]:
    """Admit each item, then queue the admitted ones of each model in one Redis step; per item, in order,
    its request IDs or the exception that refused it (nothing of that item was queued).

    Blocking (Redis): run it in a thread. An exception of the queue step itself is the outcome of every
    item of its chunk; a Redis failure there is a :class:`~protocol.errors.SubmitInterrupted` naming the
    item's IDs (made here where it had none) as ``unknown_ids``: sent again under them, it runs once.
    """
    outcomes: list[list[str] | BaseException] = [[] for _ in items]
    admitted: dict[str, list[int]] = {}
    for n, item in enumerate(items):
        item.requests = [r if r.request_id else r.model_copy(update={"request_id": uuid.uuid4().hex})
                         for r in item.requests]  # fmt: skip
        try:
            model = client.settings.model_key(item.requests[0].model)
            members = admitted.setdefault(model, [])
            unqueued = sum(len(items[m].requests) for m in members)  # admitted above, not queued yet
            client.admission.admit(model, count=len(item.requests), rate_key=item.rate_key, unqueued=unqueued)
        except Exception as exc:  # QueueFull, RateLimited, UnknownModel, a Redis error: this item alone
            outcomes[n] = exc
            continue
        members.append(n)
    for model, members in admitted.items():
        for chunk in _chunks(items, members) if members else []:
            requests = [r for n in chunk for r in items[n].requests]
            keys = [key or str(r.request_id) for n in chunk
                    for r, key in zip(items[n].requests, _keys(items[n]), strict=True)]  # fmt: skip
            try:
                if len(requests) == 1 or len(requests) > MAX_BULK_REQUESTS or any(map(generates, requests)):
                    client.send_batch(requests, routing_keys=keys)  # a task each, one Redis step
                else:
                    queue_bulk_chunk(client, model, requests, keys, list(range(len(requests))))
            except Exception as exc:
                for n in chunk:  # one Redis step: each item's requests are all queued or none, which is unknown
                    ids = [str(r.request_id) for r in items[n].requests]
                    outcomes[n] = exc
                    if isinstance(exc, REDIS_FAILURES):
                        cut = interrupted("submit", client, exc, ids, (), range(len(ids)))
                        cut.__cause__ = exc
                        outcomes[n] = cut
                continue
            for n in chunk:
                outcomes[n] = [str(r.request_id) for r in items[n].requests]
    return outcomes


def _chunks(items: Sequence[SubmitItem], members: list[int]) -> list[list[int]]:
    """``members`` cut on item boundaries into chunks of at most ``MAX_BULK_REQUESTS`` requests, generations
    and one-step requests apart (an item is never split: it is queued all or none; an item past the cap
    alone is one chunk, sent as one ``fleet.infer`` task per request)."""
    chunks: list[list[int]] = []
    for kind in (True, False):
        of_kind = [n for n in members if any(map(generates, items[n].requests)) is kind]
        size = 0
        for n in of_kind:
            count = len(items[n].requests)
            if not chunks or chunks[-1][0] not in of_kind or size + count > MAX_BULK_REQUESTS:
                chunks.append([])
                size = 0
            chunks[-1].append(n)
            size += count
    return chunks


def _keys(item: SubmitItem) -> list[str | None]:
    return list(item.routing_keys) if item.routing_keys else [None] * len(item.requests)
