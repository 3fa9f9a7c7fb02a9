"""Delivery counting: a message whose processing kills its worker is given up after ``max_deliveries``.

With ``acks_late`` a message stays unacked while it runs. If its worker dies (segfault, OOM kill,
``os._exit``), kombu restores it after ``visibility_timeout_s`` to the queue, marked
``redelivered``, and the next worker takes it, and dies too: without a count, one such message
takes the fleet down one worker at a time, forever.

The count lives in Redis under ``fleet:deliveries:<task id>`` (:data:`protocol.keys.DELIVERIES_KEY`)
so every worker sees it. A first delivery writes nothing (the common case costs no round trip);
the first *redelivery* creates the key with the first delivery included, and each delivery after
adds one. The key expires after :func:`count_ttl_s`, long enough to span every redelivery.
"""

from __future__ import annotations

from typing import Any

from protocol.keys import DELIVERIES_KEY, RUN_KEY

__all__ = ["count_delivery", "count_ttl_s", "over_limit", "running_holder"]


def count_ttl_s(*, visibility_timeout_s: int, result_ttl_s: int, max_deliveries: int) -> int:
    """How long a delivery count lives (s): every redelivery of a message happens within it.

    Each redelivery comes at least ``visibility_timeout_s`` after the one before, plus the time it
    waits in the queue; ``result_ttl_s`` bounds that wait the way it bounds the result's life.
    """
    return (max_deliveries + 1) * visibility_timeout_s + result_ttl_s


def over_limit(deliveries: int, max_deliveries: int) -> bool:
    """True when a message delivered ``deliveries`` times (this one included) must not run again."""
    return deliveries > max_deliveries


def count_delivery(client: Any, task_id: str, *, redelivered: bool, ttl_s: int) -> int:
    """Record one delivery of ``task_id``; returns how many there have been, this one included.

    Args:
        client: a redis-py client (kombu's channel client in the worker).
        redelivered: kombu's mark on a restored message; a message without it is a first delivery,
            counted as 1 without touching Redis.
        ttl_s: the key's lifetime (:func:`count_ttl_s`).
    """
    if not redelivered:
        return 1
    key = DELIVERIES_KEY.format(id=task_id)
    pipe = client.pipeline(transaction=True)
    pipe.set(key, 1, nx=True)  # the first delivery, which wrote nothing
    pipe.incr(key)
    pipe.expire(key, ttl_s)
    _, deliveries, _ = pipe.execute()
    return int(deliveries)


def running_holder(client: Any, task_id: str) -> str | None:
    """The owner of a live run claim on ``task_id`` (:mod:`workers.run_claims`), or None.

    A generation that runs longer than the visibility timeout is restored and delivered again while its
    worker lives and renews its claim: those deliveries are copies of a running generation, not a message that
    kills its worker (a dead worker's claim lapses within three of its heartbeats), so they are not counted
    against ``max_deliveries``'s verdict.
    """
    owner = client.get(RUN_KEY.format(id=task_id))
    return owner.decode(errors="replace") if isinstance(owner, bytes) else owner
