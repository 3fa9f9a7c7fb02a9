"""Poison-message guard: no queue item, however malformed, stops a worker.

kombu's Redis transport decodes each popped item inside the worker's event loop, and Celery's
strategy unpacks its headers and body there too; an exception in either stops the whole worker
("Unrecoverable error"), the unacked item comes back, and the next worker dies on it. What they
do catch, they drop with a log line. :class:`GuardedChannel` sits where the item is taken
(``_brpop_read``: :mod:`broker.atomic_take`, or kombu's ``BRPOP`` where Redis refuses that), before
any of that, and for each item:

1. checks the envelope (:func:`broker.message_check.parse_envelope`);
2. counts the delivery when kombu marked it redelivered (:mod:`broker.deliveries`) and gives up
   on a message past ``worker.max_deliveries`` (its processing killed the worker each time);
3. checks headers, content type, encodings and body layout, then that its ``eta`` is not further
   ahead than the visibility timeout allows (:func:`broker.message_check.check_message`,
   :mod:`broker.eta_window`: held longer, the message would be restored to another worker and run twice);
4. hands it to kombu and Celery only when every check passed.

A refused item is pushed to the dead-letter list with why, where and when
(:mod:`protocol.deadletter`), gets a FAILURE result under its task ID when it has one (stored
through the app's result backend, as Celery stores a task's failure, with a
:class:`~protocol.errors.DecodeError` naming the field): :mod:`broker.dead_letter_writer`. It is gone
from the queue: it was taken, and its unacked entry (the atomic take records one for an item with a
delivery tag) is removed once the dead letter is written, which is what an ack would do.

:func:`install` runs in the worker process only (producers never decode queue items); the worker's app,
hostname and limits reach the guard through :mod:`broker.guard_config`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.encoding import bytes_to_str

from broker.atomic_take import OTHER_LISTS_WAIT_S, TAKE_TRANSPORT_OPTIONS, start_peek, take_after_peek
from broker.batch_take import MARK_REPLY, WITH_MARK, Taken, TakeNotRecorded, record_batch, room_for_more
from broker.cancel_marks import CancelReadingQoS
from broker.dead_letter_writer import write_dead_letter
from broker.deliveries import count_delivery, over_limit, running_holder
from broker.guard_config import GuardConfig, configure, configure_at_worker_setup, current
from broker.in_hand import IN_HAND
from broker.kombu_channel import ReusesSyncClient
from broker.message_check import Accepted, Envelope, Refused, check_message, parse_envelope
from broker.redis_refusals import (
    BrokerChannelClosed,
    RedisRefusingWrites,
    is_write_refusal,
    raise_write_refusals_as_connection_errors,
)
from broker.store_ack import StoreAckingQoS
from protocol.deadletter import Reason
from protocol.keys import DEAD_LETTER_KEY
from protocol.settings import FleetSettings

__all__ = ["DEAD_LETTER_KEY", "CheckedMessage", "GuardConfig", "GuardedChannel", "GuardedSentinelChannel", "configure",
           "install"]

log = logging.getLogger("fleet.poison")


class CheckedMessage(virtual.Message):
    """kombu's message, holding the body the guard already decoded: Celery's ``Request`` reads
    ``message.payload`` in the event loop, and need not decode the same bytes a second time."""

    def __init__(self, payload: Any, channel: Any = None, **kwargs: Any) -> None:
        super().__init__(payload, channel=channel, **kwargs)  # type: ignore[no-untyped-call]
        checked = getattr(channel, "checked_bodies", None)
        body = checked.pop(self.delivery_tag, None) if isinstance(checked, dict) else None
        if body is not None:
            self._decoded_cache = body


class GuardedChannel(ReusesSyncClient, kombu_redis.Channel):
    """kombu's Redis channel, except that it only delivers items Celery can take (see the module doc)."""

    Message = CheckedMessage
    QoS = StoreAckingQoS  # + the cancel mark at take (broker.cancel_marks), the ack in the store (broker.store_ack)
    take_batch = True
    """Take up to the worker's free tokens per round trip when the queue is backed up (:mod:`broker.batch_take`)."""
    take_atomic = True
    """Take and record as unacked in one script run after a wait that pops nothing (:mod:`broker.atomic_take`);
    turned off (kombu's ``BRPOP``) when Redis refuses it."""
    peek_sent = False
    """The command pending on the ``BRPOP`` connection is the atomic take's wait, not ``BRPOP``."""
    take_keys: tuple[str, ...] = ()
    """The lists the pending wait's take looks at, in kombu's order."""
    take_script: Any = None
    """The take script, registered on the synchronous client."""
    other_lists_wait_s = OTHER_LISTS_WAIT_S
    """Longest wait on one list when the worker consumes several (s); transport option ``other_lists_wait_s``."""
    shared_queue: str | None = None
    """The queue the worker shares with the other workers of its model (transport option ``shared_queue``): the
    atomic take's wait sits on it unless the last take's list is still backed up (:mod:`broker.atomic_take`)."""
    take_last_list: str | None = None
    """The list the last take came from, until a wait finds every list empty (:mod:`broker.atomic_take`)."""
    from_transport_options = (  # type: ignore[assignment]
        *kombu_redis.Channel.from_transport_options, *TAKE_TRANSPORT_OPTIONS
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.checked_bodies: dict[str, list[Any]] = {}
        self.pre_taken: dict[str, bool | None] = {}
        """Deliveries already recorded as unacked (tag → its cancel mark, None when not read), until the QoS
        takes them in (:mod:`broker.batch_take`)."""
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]

    def _brpop_start(self, timeout: Any = None) -> None:
        if not start_peek(self, timeout):
            self.peek_sent = False
            super()._brpop_start(timeout)  # type: ignore[no-untyped-call]

    def _brpop_read(self, **options: Any) -> bool:
        try:
            if self.peek_sent:
                return take_after_peek(self, **options)
            with IN_HAND.taking() as take:  # the poller saw the reply: it may carry a message off its list
                try:
                    dest__item = self.client.parse_response(self.client.connection, "BRPOP", **options)
                except self.connection_errors:
                    self.client.connection.disconnect()
                    raise
                except redis.exceptions.ResponseError as exc:
                    if not is_write_refusal(exc):
                        raise
                    self.client.connection.disconnect()  # Celery reconnects, with backoff, until Redis takes writes
                    raise RedisRefusingWrites(f"Redis refused BRPOP: {exc}") from exc
                if not dest__item:
                    raise kombu_redis.Empty()  # type: ignore[attr-defined]
                take.took(1)  # in hand until _take hands it over or refuses it
            dest, item = dest__item
            list_key = bytes_to_str(dest)  # type: ignore[no-untyped-call]
            queue = list_key.rsplit(self.sep, 1)[0]
            self._queue_cycle.rotate(queue)
            self._take(queue, list_key, item if isinstance(item, bytes) else str(item).encode())
            return True
        finally:
            self._in_poll = None  # type: ignore[assignment]
            flush = getattr(self, "_flush_brpop_reauth", None)
            if flush is not None:
                flush()

    def _take(self, queue: str, list_key: str, item: bytes) -> None:
        """Deliver ``item`` (counted as taken in :data:`~broker.in_hand.IN_HAND`) and, the queue backed up,
        up to the worker's free tokens more (:mod:`broker.batch_take`); dead-letter what the checks refuse.
        Never raises for an item's sake."""
        first_in_hand = 1  # until its hand-over starts, or it is refused or parked
        try:
            if not isinstance(self.qos, CancelReadingQoS):  # a QoS that records each delivery itself
                alone = self._check(queue, list_key, item)
                if alone is not None:
                    first_in_hand = 0
                    with IN_HAND.handing_over(alone.task_id):
                        self._deliver_checked(queue, list_key, alone)
                return
            room = room_for_more(self.qos) if self.take_batch else 0
            first = self._check(queue, list_key, item)
            recorded = [first] if first is not None else []
            if room > 0:
                with IN_HAND.taking() as take:  # company on its way for the first one's task (broker.in_hand)
                    popped = self._record(list_key, recorded, pop=room)
                    take.took(len(popped))
            else:
                popped = self._record(list_key, recorded, pop=0)
            first = recorded[0] if recorded else None  # retagged where another delivery held its tag
            if first is not None:
                first_in_hand = 0
            self._deliver_taken(queue, list_key, first, popped)
        finally:
            if first_in_hand:
                IN_HAND.handing(first_in_hand)

    def _deliver_taken(self, queue: str, list_key: str, first: Taken | None, popped: list[bytes]) -> None:
        """Hand ``first`` (recorded as unacked, counted as taken) to Celery, then check, record and hand
        over ``popped`` (counted as taken); parks what is not recorded when a delivery raises."""
        unrecorded = popped
        in_hand = len(popped)
        try:
            if first is not None:
                with IN_HAND.handing_over(first.task_id):  # counted as taken since its BRPOP reply was read
                    self._deliver_checked(queue, list_key, first)
            if popped:
                more = [taken for taken in (self._check(queue, list_key, raw) for raw in popped) if taken is not None]
                unrecorded = []  # checked: refused ones are dead-lettered, the rest parked by _record if it fails
                IN_HAND.handing(in_hand - len(more))
                in_hand = len(more)
                self._record(list_key, more, pop=0)
                for taken in more:
                    in_hand -= 1
                    with IN_HAND.handing_over(taken.task_id):  # until Celery's call returns: it reserves it inside
                        self._deliver_checked(queue, list_key, taken)
        except BaseException:
            for raw in unrecorded:
                self._park(list_key, raw)
            raise
        finally:
            IN_HAND.handing(in_hand)

    def _record(self, list_key: str, batch: list[Taken], *, pop: int) -> list[bytes]:
        """Record ``batch`` as unacked deliveries (noting each cancel mark in ``pre_taken``) and, with
        ``pop`` > 0, ``RPOP`` up to that many more items of ``list_key``, in one pipeline; returns them.

        A delivery whose tag another unacked delivery holds (a sender that reuses tags, or two of ``batch``)
        is recorded under a tag of its own (:func:`~broker.batch_take.record_batch`, one more round trip) and
        replaced in ``batch``
        by its retagged self, as the atomic take does: each keeps an unacked entry to be restored from.

        Raises:
            redis.exceptions.ConnectionError: the pipeline failed or Redis refused a write; ``batch``
                was parked (:class:`~broker.redis_refusals.ParkedItems`) before.
        """
        if not batch and pop <= 0:
            return []
        try:
            with self.conn_or_acquire() as client:
                counts, replies = record_batch(client, self.qos, batch, list_key.split(self.sep, 1)[0], list_key, pop)
        except Exception as exc:
            for taken in batch:
                self._park(list_key, taken.raw)
            if is_write_refusal(exc):
                raise RedisRefusingWrites(f"Redis refused to record messages from {list_key}: {exc}") from exc
            if isinstance(exc, redis.exceptions.ConnectionError):
                raise
            raise TakeNotRecorded(f"Redis refused to record messages from {list_key}: {exc}") from exc
        offset = 0
        for taken, count in zip(batch, counts, strict=True):
            self.pre_taken[taken.tag] = bool(replies[offset + MARK_REPLY]) if count == WITH_MARK else None
            offset += count
        if pop <= 0:
            return []
        more = replies[offset]
        if isinstance(more, Exception):  # Redis < 6.2: RPOP takes no count
            log.warning("Redis refused RPOP with a count (%s): taking one message per round trip", more)
            self.take_batch = False
            return []
        return [raw if isinstance(raw, bytes) else str(raw).encode() for raw in more or []]

    def _check(self, queue: str, list_key: str, item: bytes) -> Taken | None:
        """The item as a :class:`Taken`, or None when the checks refused it (it was dead-lettered)."""
        try:
            verdict = self._verdict(item)
        except Exception as exc:  # a bug in the checks must not become the poison either
            log.exception("queue %s: the checks raised on an item", queue)
            verdict = Refused(Reason.WORKER_ERROR, "item", f"the checks raised {type(exc).__name__}: {exc}"[:500],
                              "an item the checks can read")
        if isinstance(verdict, Refused):
            self._dead_letter(queue, list_key, item, verdict)
            return None
        envelope, checked = verdict
        return Taken.of(envelope.payload, checked.body, item, envelope.task_id, envelope.task)

    def _deliver_checked(self, queue: str, list_key: str, taken: Taken) -> None:
        """Hand a checked message to kombu/Celery; what Celery raises on it dead-letters it."""
        tag = taken.tag
        self.checked_bodies[tag] = taken.body
        try:
            self.connection._deliver(taken.payload, queue)
        except Exception as exc:  # a guard of last resort: whatever the checks missed must not stop us
            if is_write_refusal(exc):
                # popped, but Redis refused to record it as unacked: only this process holds it now
                self._park(list_key, taken.raw)
                raise RedisRefusingWrites(f"Redis refused to record a message from {queue}: {exc}") from exc
            # kombu counts KeyError among "connection errors" (a stale poller fd); from Celery's
            # strategy it means a message it could not read, so only real I/O errors go up
            if isinstance(exc, self.connection_errors + self.connection.channel_errors) and not isinstance(
                exc, KeyError
            ):
                raise
            log.exception("queue %s: Celery raised on a message that passed the checks", queue)
            self._forget_unacked(tag)
            self._dead_letter(queue, list_key, taken.raw, Refused(
                Reason.WORKER_ERROR, "message", f"the worker raised {type(exc).__name__}: {exc}"[:500],
                "a message Celery accepts", taken.task_id, taken.task))
        finally:
            self.checked_bodies.pop(tag, None)
            self.pre_taken.pop(tag, None)

    def _verdict(self, item: bytes) -> Refused | tuple[Envelope, Accepted]:
        """Envelope, delivery count, then the rest (:mod:`broker.message_check`)."""
        cfg = current()
        envelope = parse_envelope(item)
        if isinstance(envelope, Refused):
            return envelope
        if cfg is not None and envelope.task_id is not None and envelope.redelivered:
            deliveries = self._count(cfg, envelope.task_id)
            if (deliveries is not None and over_limit(deliveries, cfg.max_deliveries)
                    and not self._running_elsewhere(envelope.task_id, deliveries)):
                return Refused(
                    Reason.MAX_DELIVERIES, "deliveries",
                    f"delivered {deliveries - 1} times without an ack (its worker died each time, or it outlived "
                    f"the visibility timeout); max_deliveries={cfg.max_deliveries}",
                    str(cfg.max_deliveries), envelope.task_id, envelope.task, deliveries,
                )
        # the ETA against kombu's own visibility timeout (what this channel restores by); wall time, as an ETA is
        checked = check_message(envelope, cfg.app.tasks if cfg is not None else None, now_unix_s=time.time(),
                                visibility_timeout_s=float(self.visibility_timeout))
        return checked if isinstance(checked, Refused) else (envelope, checked)

    def _running_elsewhere(self, task_id: str, deliveries: int) -> bool:
        """True when a live worker holds ``task_id``'s run claim: this copy of a generation that outlived the
        visibility timeout then runs as any copy does (it waits for the outcome, :mod:`workers.run_claims`)."""
        try:
            with self.conn_or_acquire() as client:
                holder = running_holder(client, task_id)
        except Exception:  # unknown: the count's verdict stands
            log.exception("could not read the run claim of %s", task_id)
            return False
        if holder is not None:
            log.warning("%s delivered %d times without an ack while its generation runs (claimed by %s): it "
                        "outlived visibility_timeout_s; this copy waits for its outcome instead of being "
                        "dead-lettered", task_id, deliveries - 1, holder.partition(" ")[2] or holder)  # fmt: skip
        return holder is not None

    def _count(self, cfg: GuardConfig, task_id: str) -> int | None:
        try:
            with self.conn_or_acquire() as client:
                return count_delivery(client, task_id, redelivered=True, ttl_s=cfg.count_ttl_s)
        except Exception:  # an uncounted delivery still runs, as it would have without the guard
            log.exception("could not count a delivery of %s", task_id)
            return None

    def _dead_letter(self, queue: str, list_key: str, item: bytes, refused: Refused) -> None:
        """Push the entry, then store the FAILURE result of the message's task ID (when it has one)
        (:func:`broker.dead_letter_writer.write_dead_letter`)."""
        write_dead_letter(self.conn_or_acquire, current(), queue, list_key, item, refused)

    def _park(self, list_key: str, item: bytes) -> None:
        cfg = current()
        parked = cfg.parked if cfg is not None else None
        if parked is None:
            log.error("Redis refused to record a message taken from %s and no store for it is configured: "
                      "it is lost (%d bytes)", list_key, len(item))
            return
        parked.park(list_key, item)

    def _connparams(self, asynchronous: bool = False) -> Any:
        # kombu reads the connection's address from its transport's client, which is None once the
        # consumer closed the connection to reconnect: a task thread acking then raised AttributeError
        # in the event loop, "Unrecoverable error", and the worker exited. A closed channel is a lost
        # connection, which Celery handles by reconnecting.
        if getattr(self.connection, "client", None) is None:
            raise BrokerChannelClosed("the broker connection of this channel was closed (reconnecting)")
        return super()._connparams(asynchronous)  # type: ignore[no-untyped-call]

    def _forget_unacked(self, delivery_tag: str) -> None:
        """Ack a delivery that Celery raised on, if kombu took it in, so it is not restored later."""
        try:
            if delivery_tag in getattr(self.qos, "_delivered", {}):
                self.qos.ack(delivery_tag)
        except Exception:
            log.exception("could not ack delivery %s", delivery_tag)


class GuardedSentinelChannel(GuardedChannel, kombu_redis.SentinelChannel):
    """The same guard, batched take, cancel mark at take and ack in the store on kombu's Sentinel channel
    (its connections follow the master Sentinel names)."""

    from_transport_options = (  # type: ignore[assignment]
        *kombu_redis.SentinelChannel.from_transport_options, *TAKE_TRANSPORT_OPTIONS
    )


def install(
    app: Celery | None = None,
    settings: FleetSettings | None = None,
    hostname: str | None = None,
    *,
    worker_settings: Callable[[], FleetSettings | None] | None = None,
) -> None:
    """Make every Redis transport in this process use :class:`GuardedChannel` (Sentinel:
    :class:`GuardedSentinelChannel`).

    With ``app`` and ``settings`` the guard is configured at once; without them (called from
    ``worker_init``) it configures itself at ``celeryd_after_setup``, from the worker being set up and
    the settings ``worker_settings()`` returns then (the worker's runtime, built by then, before the
    consumer starts; None, or no ``worker_settings``: the guard runs unconfigured, with a warning).
    """
    kombu_redis.Transport.Channel = GuardedChannel
    kombu_redis.SentinelTransport.Channel = GuardedSentinelChannel
    raise_write_refusals_as_connection_errors()
    if app is not None and settings is not None:
        configure(app, settings, hostname or "unknown")
    else:
        configure_at_worker_setup(worker_settings)
