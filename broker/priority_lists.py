"""How many messages wait in Celery queues: each queue's Redis list and kombu's priority siblings.

kombu's Redis transport keeps priorities 3/6/9 in sibling lists ``<queue>\\x06\\x16<n>`` (its ``sep``
and ``priority_steps``), so a queue's depth is the sum of four ``LLEN`` replies. The producer's admission
reads it (:mod:`producer.admission`), and a worker reads it for the lists it takes from while a
burst of generations is held to start together (:mod:`workers.scheduler`).
"""

from __future__ import annotations

import redis
from kombu.transport import redis as kombu_redis

__all__ = ["KOMBU_PRIORITY_SEP", "KOMBU_PRIORITY_STEPS", "queue_depth", "queue_lists"]

KOMBU_PRIORITY_SEP: str = kombu_redis.Channel.sep
"""kombu's separator between a queue's name and a priority step (``"\\x06\\x16"``)."""
KOMBU_PRIORITY_STEPS = tuple(step for step in kombu_redis.Channel.priority_steps if step)
"""kombu's priority steps with a list of their own (3, 6, 9: step 0 is the queue's own list)."""


def queue_lists(queue: str) -> list[str]:
    """The Redis lists that hold Celery queue ``queue``'s messages: its own list, then kombu's priority
    siblings in step order."""
    return [queue, *(f"{queue}{KOMBU_PRIORITY_SEP}{step}" for step in KOMBU_PRIORITY_STEPS)]


def queue_depth(client: redis.Redis[bytes], queue: str, *more: str) -> int:
    """Requests waiting in Celery queue ``queue`` and any ``more`` queues (each one's Redis list plus
    kombu's priority siblings), read in one round trip."""
    with client.pipeline(transaction=False) as pipe:
        for name in (queue, *more):
            for listed in queue_lists(name):
                pipe.llen(listed)
        return sum(int(n) for n in pipe.execute())
