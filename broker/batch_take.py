"""Taking a backed-up queue's messages several per round trip, up to the worker's free tokens.

kombu's Redis transport takes one message per turn of the worker's event loop: ``BRPOP`` (one round
trip), the delivery's bookkeeping (``ZADD`` + ``HSET`` + the cancel mark's ``EXISTS``, another), then
``BRPOP`` is sent again on the next turn. The consumer thread does that serially, between task
threads that want the GIL, so with the queue backed up a worker took its messages more slowly than
it computed them: ``fleet bench`` at 32 clients against one worker of C = 16 tokens sampled 2.6
requests held on average while 27 waited in Redis, and a third of both cores idle.

The worker's channel takes with :mod:`broker.atomic_take` (a wait that pops nothing, then one script
that records up to the free tokens' messages as unacked and only then trims them off the list). Where
Redis refuses that (before 6.2, an ACL), :class:`broker.poison.GuardedChannel` takes with kombu's
``BRPOP`` instead, and batches it this way when ``BRPOP`` returns a message:

1. the message's bookkeeping and ``RPOP <list> n`` go in one pipeline, ``n`` = the worker's free
   tokens beyond this message (kombu's prefetch estimate, :func:`room_for_more`), then the message is
   delivered to Celery;
2. the messages ``RPOP`` returned are checked by the guard, recorded as unacked in one more pipeline
   and delivered in order.

So a lone request costs what it did (one round trip after ``BRPOP``, one more command, an ``RPOP``
that finds nothing), and a backed-up queue costs three round trips for up to C messages instead of
two each. The token bucket is unchanged: no more messages are held than kombu's prefetch allows.

The kill window of this fallback: as with kombu's ``BRPOP``, a message is off the list before the
write that records it as unacked, so a worker SIGKILLed in between loses it for good, here up to C
messages (the ``RPOP`` extras wait for the first message's delivery and the guard's checks).
Measured (``tests/integration/test_take_kills.py``, docs/reliability.md): 200 kills at random
instants lost 159 of 4,437 messages on this path, 0 with the atomic take. A pipeline that fails
leaves its messages with :class:`broker.redis_refusals.ParkedItems`, which pushes them back to the
queue. Redis before 6.2 has no count for ``RPOP``: its first refusal turns the batches off for that
channel, and the worker takes one message per turn as kombu does.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

import redis
from kombu.utils.json import dumps

from protocol.keys import CANCEL_KEY, TAKEN_KEY

RETAG = "~retag~"
"""Between a message's own delivery tag and the suffix a take gives it when another unacked message holds that
tag already (a sender that reuses tags): each delivery keeps an unacked entry of its own."""

log = logging.getLogger("fleet.poison")

__all__ = ["MARK_REPLY", "WITH_MARK", "TakeNotRecorded", "Taken", "add_take", "record_batch", "room_for_more",
           "taken_note_life_s", "unacked_entry_of"]


class TakeNotRecorded(redis.exceptions.ConnectionError):
    """Redis answered the bookkeeping of a take with an error; its messages were parked, not lost.

    A connection error, so that Celery reconnects with backoff instead of stopping the worker."""


@dataclass(frozen=True)
class Taken:
    """A message the guard accepted, to be recorded as unacked and delivered."""

    payload: dict[str, Any]
    """kombu's envelope, decoded."""
    body: Any
    """The task body the guard decoded (``[args, kwargs, embed]``), handed on so Celery need not decode it again."""
    raw: bytes
    """The bytes the list held."""
    tag: str
    """kombu's delivery tag."""
    task_id: str | None
    task: str | None
    """The task's name."""

    @classmethod
    def of(cls, payload: dict[str, Any], body: Any, raw: bytes, task_id: str | None, task: str | None) -> Taken:
        return cls(payload, body, raw, str(payload["properties"]["delivery_tag"]), task_id, task)

    def retagged(self, tag: str) -> Taken:
        """The same message delivered under ``tag``: the take recorded it so because another message held its
        own tag in the unacked hash (one entry per tag: the later one overwrote the first's, which a dead
        worker then never got back). kombu's message, its ack and the store's ack use ``tag``; a restore
        puts the list's bytes back, with the tag the sender gave."""
        payload = {**self.payload, "properties": {**self.payload["properties"], "delivery_tag": tag}}
        return dataclasses.replace(self, payload=payload, tag=tag)


def unacked_entry_of(raw: bytes, queue: str) -> bytes:
    """kombu's unacked hash entry ``[message, exchange, routing_key]``, with the list's bytes spliced in
    as the message (the same JSON value kombu would encode again), and the default exchange with the
    ``queue`` it was taken from as the routing: kombu restores it there (onto its priority's list), not
    where its envelope's ``delivery_info`` points, which a sender may have written to name a queue
    nobody consumes, or an exchange kombu cannot look up (the message would be restored nowhere)."""
    tail = str(dumps(["", queue]))  # type: ignore[no-untyped-call]
    return b"[" + raw + b"," + tail[1:].encode()


def add_take(pipe: Any, qos: Any, tag: str, entry: bytes | str, task_id: str | None, now_s: float, *,
             exclusive: bool = False) -> int:  # fmt: skip
    """Queue one delivery's bookkeeping on ``pipe``: ``ZADD`` of its tag to kombu's unacked index at
    ``now_s`` (Unix s), ``HSET`` of its entry (``HSETNX`` when ``exclusive``: its reply, 0, says another
    delivery holds the tag, whose entry is left as it was), and, when it has a task ID, its taken note then
    ``EXISTS`` of its cancel mark (the note first: a cancel that comes before it is for good and the
    ``EXISTS`` reads it; one after it is asked of this worker, :mod:`protocol.cancel_marks`).

    Returns the number of commands queued (their replies come in that order; the mark's at
    :data:`MARK_REPLY` when :data:`WITH_MARK` were queued)."""
    pipe.zadd(qos.unacked_index_key, {tag: now_s})
    if exclusive:
        pipe.hsetnx(qos.unacked_key, tag, entry)
    else:
        pipe.hset(qos.unacked_key, tag, entry)
    if task_id is None:
        return 2
    pipe.set(TAKEN_KEY.format(id=task_id), "1", ex=taken_note_life_s(getattr(qos, "channel", None)))
    pipe.exists(CANCEL_KEY.format(id=task_id))
    return WITH_MARK


WITH_MARK = 4
"""Commands :func:`add_take` queues for a delivery with a task ID."""
MARK_REPLY = 3
"""Where, among those commands' replies, the cancel mark's ``EXISTS`` answers."""


def taken_note_life_s(channel: Any) -> int:
    """How long a taken note (``fleet:taken:<id>``) lives (s): the channel's visibility timeout, after which a
    message a dead worker held is restored to its queue (at least 1 s)."""
    return max(1, int(float(getattr(channel, "visibility_timeout", 3600) or 3600)))


def room_for_more(qos: Any) -> int:
    """How many more messages the worker may hold beside the one just popped (0 without a prefetch limit)."""
    estimate = qos.can_consume_max_estimate()
    return max(0, int(estimate) - 1) if estimate else 0


def record_batch(client: Any, qos: Any, batch: list[Taken], queue: str, list_key: str,
                 pop: int) -> tuple[list[int], list[Any]]:  # fmt: skip
    """Record ``batch`` (taken from ``queue``'s list ``list_key``) as unacked deliveries, each with its cancel
    mark's ``EXISTS``, and ``RPOP`` up to ``pop`` more items of the list, in one pipeline. Returns how many
    commands each delivery queued (:func:`add_take`) and the pipeline's replies (the ``RPOP``'s last).

    A delivery whose tag another unacked delivery holds (a sender that reuses tags, or two of ``batch``)
    keeps that entry untouched (``HSETNX``) and is recorded under a tag of its own in one more round trip:
    the sender's tag, :data:`RETAG`, the time in ns and its position, the atomic take's form. Its retagged
    self (:meth:`Taken.retagged`) replaces it in ``batch``, so kombu's message and the acks use that tag.

    Raises:
        Exception: the first command Redis refused, or the pipeline's own failure.
    """
    pipe = client.pipeline(transaction=False)
    now = time.time()
    entries = [unacked_entry_of(taken.raw, queue) for taken in batch]
    counts = [add_take(pipe, qos, taken.tag, entry, taken.task_id, now, exclusive=True)
              for taken, entry in zip(batch, entries, strict=True)]  # fmt: skip
    if pop > 0:
        pipe.rpop(list_key, pop)
    replies = list(pipe.execute(raise_on_error=False))
    _raise_first_refusal(replies[: sum(counts)])
    starts = [sum(counts[:i]) for i in range(len(counts))]
    held = [i for i, start in enumerate(starts) if not replies[start + 1]]  # HSETNX answered 0
    if held:
        retag = client.pipeline(transaction=False)
        stamp = time.time_ns()
        for i in held:
            tag = f"{batch[i].tag}{RETAG}{stamp}.{i}"
            retag.zadd(qos.unacked_index_key, {tag: now})
            retag.hset(qos.unacked_key, tag, entries[i])
            batch[i] = batch[i].retagged(tag)
        _raise_first_refusal(retag.execute(raise_on_error=False))
        log.warning("%d of %d messages taken from %s carried a delivery tag another unacked delivery holds (a "
                    "sender reusing tags): recorded under tags of their own", len(held), len(batch), queue)  # fmt: skip
    return counts, replies


def _raise_first_refusal(replies: list[Any]) -> None:
    failed = next((r for r in replies if isinstance(r, Exception)), None)
    if failed is not None:
        raise failed
