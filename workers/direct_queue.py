"""A worker's own queue for prefix-aware routing, and what it tells producers about its prefix cache.

With ``models.<m>.routing.prefix_aware`` on (and a prefix cache), each worker of ``m`` consumes a queue
of its own, ``FleetSettings.direct_queue_for(m, hostname)``, beside the model's queue and canary
queue. Producers send there the generations whose prompt starts with a prefix this worker holds
(:mod:`producer.prefix_routing`), so the prefill of that prefix is skipped.

Two things keep routing honest:

* :class:`PrefixHolder` publishes the block digests the worker's prefix cache holds
  (:data:`protocol.keys.PREFIX_HOLDER_KEY`, a set refreshed with the heartbeat), told by the
  cache's listener and written by a thread of its own, so the scheduler never waits on Redis.
* :class:`DirectQueue` makes sure nothing is stranded in the queue of a worker that died: every
  heartbeat registers this worker in :data:`protocol.keys.DIRECT_QUEUES_KEY` (scored by its heartbeat's
  expiry) and moves the queue of every registered worker past its expiry onto the model's queue, in
  one script per queue (:data:`MOVE_SCRIPT`, priority siblings too), oldest first at the head. A dead worker stays
  registered for ``visibility_timeout_s`` + one restore interval + a heartbeat TTL more, because its
  unacked requests come back (kombu's restore) into its own queue and must be moved too.
  A worker that stops cleanly moves its own queue at once. Producers route only to a live worker
  registered there (:mod:`producer.prefix_routing`).

Every worker has a :class:`DirectQueue`, also one that does not consume its own queue (routing off in its
config, a model that does not generate): its name may still receive requests. A predecessor under the same
hostname, SIGKILLed while it consumed one, leaves its prefix-digest set (alive for its TTL, so producers
still find it holding prefixes), its registration, and requests in the queue; restored unacked requests
arrive there later too. So at start (:meth:`DirectQueue.start`, before the consumer runs) a worker deletes
that set, moves what waits in its queue onto the model's queue and, when it does not consume the queue,
withdraws the registration, in one step; and a worker that does not consume its queue moves whatever
reaches it with every heartbeat, and rescues dead workers' queues like the others (it may be the last
worker of its model).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time

import redis

from broker import queue_lists
from protocol.keys import DIRECT_QUEUES_KEY, PREFIX_HOLDER_KEY

__all__ = ["MOVE_SCRIPT", "PUBLISH_WAIT_S", "DirectQueue", "PrefixHolder", "move_keys"]

PUBLISH_WAIT_S = 1.0
"""Longest wait of :meth:`PrefixHolder.sync` (s): a Redis that does not take the digests delays a result by
no more than this (routing is a hint)."""

log = logging.getLogger("fleet.routing")

MOVE_SCRIPT = """
local moved = 0
for i = 1, #KEYS, 2 do
  while true do
    local item = redis.call('LMOVE', KEYS[i], KEYS[i + 1], 'LEFT', 'RIGHT')
    if not item then break end
    moved = moved + 1
  end
end
return moved
"""
"""KEYS: pairs of (a queue's list, where it goes): a dead worker's queue and each of kombu's priority sibling
lists, each onto the model queue's list of the same priority (:func:`move_keys`). Moves every item, newest
first onto the head (the right end, where workers take), so the oldest is taken first; returns the count."""


def move_keys(source: str, target: str) -> list[str]:
    """:data:`MOVE_SCRIPT`'s keys for moving Celery queue ``source`` onto ``target``: its own list and kombu's
    priority siblings (a message sent with a priority, or restored with one, waits in a sibling)."""
    return [key for pair in zip(queue_lists(source), queue_lists(target), strict=True) for key in pair]


class DirectQueue:
    """This worker's own queue: registration (when consumed), the rescue of dead workers' queues, and, when
    not consumed, keeping it empty."""

    def __init__(
        self, client: redis.Redis[bytes], *, model: str, hostname: str, name: str, shared: str, linger_s: float,
        consumed: bool = True,
    ) -> None:
        """``name``: this worker's queue; ``shared``: the model's queue; ``linger_s``: how long a dead
        worker stays registered past its heartbeat's expiry (s); ``consumed``: this worker takes from
        ``name`` (False: it never registers, and moves what reaches ``name`` every beat)."""
        self.client = client
        self.model = model
        self.hostname = hostname
        self.name = name
        self.shared = shared
        self.linger_s = linger_s
        self.consumed = consumed
        self._registry = DIRECT_QUEUES_KEY.format(model=model)
        self._holder_key = PREFIX_HOLDER_KEY.format(model=model, host=hostname)
        self._prefix = name[: -len(hostname)]  # "<model queue>.w."
        self._move = client.register_script(MOVE_SCRIPT)
        self.rescued = 0
        """Requests this worker moved from dead workers' queues onto the model's queue."""
        self.swept = 0
        """Requests this worker moved from its own queue onto the model's queue: left by a predecessor under
        its hostname, or (not consumed) routed there since."""

    def start(self) -> int:
        """Take over from an earlier process of this hostname, before the consumer runs: delete the prefix-digest
        set it published (this process holds nothing yet), withdraw its registration when this worker does not
        consume the queue (one that does registers at its first beat), and move what waits in the queue onto
        the model's queue, in one transaction. Returns the requests moved; a Redis error is logged (0): the
        queue is consumed, or swept every beat, and the predecessor's registration and set expire.
        """
        try:
            with self.client.pipeline(transaction=True) as pipe:
                pipe.delete(self._holder_key)  # routers stop sending here before the queue is emptied
                if not self.consumed:
                    pipe.zadd(self._registry, {self.hostname: time.time()}, xx=True)
                self._move(keys=move_keys(self.name, self.shared), client=pipe)
                moved = int(pipe.execute()[-1])
        except redis.RedisError as exc:
            log.warning("could not take over this worker's own queue %s from an earlier process: %s", self.name, exc)
            return 0
        if moved:
            self.swept += moved
            log.warning("moved %d requests an earlier process of %s left in its own queue to %s", moved,
                        self.hostname, self.shared)  # fmt: skip
        return moved

    def beat(self, expires_unix_s: float) -> None:
        """Register this worker until ``expires_unix_s`` (when consumed), move what reached its queue (when not),
        then rescue dead workers' queues (heartbeat thread)."""
        now = time.time()
        with self.client.pipeline(transaction=False) as pipe:
            if self.consumed:
                pipe.zadd(self._registry, {self.hostname: expires_unix_s})
                # the registry outlives its last worker by as long as it watches a dead one, then goes
                pipe.expire(self._registry, max(1, int(expires_unix_s - now + self.linger_s + 1)))
            pipe.zrangebyscore(self._registry, "-inf", now)
            dead = pipe.execute()[-1]
        if not self.consumed:
            self._sweep()
        for raw in dead:
            host = raw.decode() if isinstance(raw, bytes) else str(raw)
            if host == self.hostname and not self.consumed:
                continue  # swept above
            moved = int(self._move(keys=move_keys(self._prefix + host, self.shared)))
            if moved:
                self.rescued += moved
                log.warning("moved %d requests from the queue of dead worker %s to %s", moved, host, self.shared)
        self.client.zremrangebyscore(self._registry, "-inf", now - self.linger_s)

    def _sweep(self) -> None:
        """Move what reached the queue this worker does not consume onto the model's queue."""
        moved = int(self._move(keys=move_keys(self.name, self.shared)))
        if moved:
            self.swept += moved
            log.warning("moved %d requests from this worker's own queue, which it does not consume, to %s", moved,
                        self.shared)  # fmt: skip

    def withdraw(self) -> None:
        """A clean stop: move what waits in this worker's queue onto the model's queue, and mark it expired
        (it stays registered ``linger_s``, in case a request it held comes back; a worker that did not consume
        the queue is marked only where a predecessor left it registered)."""
        with contextlib.suppress(redis.RedisError):
            self.client.zadd(self._registry, {self.hostname: time.time()}, xx=not self.consumed)
            moved = int(self._move(keys=move_keys(self.name, self.shared)))
            if moved:
                log.info("moved %d requests from this worker's queue to %s", moved, self.shared)


class PrefixHolder:
    """Publishes the prefix cache's block digests (a :class:`~workers.generation.prefix_cache.PrefixListener`).

    ``held``/``released`` only enqueue; a thread writes them (SADD/SREM, pipelined, in order) and keeps
    the set's TTL; Redis errors are logged and the changes dropped (routing is a hint: a stale digest
    costs a miss, never a wrong answer). :meth:`sync` waits for what was enqueued before it: a generation's
    result and its stream's last event are written after it, so a caller who has the reply finds its
    conversation held when it sends the next turn.
    """

    def __init__(self, client: redis.Redis[bytes], *, model: str, hostname: str, ttl_s: int) -> None:
        self.client = client
        self.key = PREFIX_HOLDER_KEY.format(model=model, host=hostname)
        self.ttl_s = ttl_s
        self._changes: queue.SimpleQueue[tuple[str, list[bytes]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="fleet-prefix-holder", daemon=True)
        self.published = 0
        """Digest changes written."""
        self._progress = threading.Condition()
        self._enqueued = 0
        """Changes enqueued so far."""
        self._settled = 0
        """Changes written or dropped so far (they settle in the order they were enqueued)."""

    def start(self) -> None:
        """Start the writer (and drop whatever an earlier process of this hostname left)."""
        with contextlib.suppress(redis.RedisError):
            self.client.delete(self.key)
        self._thread.start()

    def held(self, digests: list[bytes]) -> None:
        """The cache holds these digests now (scheduler thread; does not block)."""
        self._enqueue(("add", digests))

    def released(self, digests: list[bytes]) -> None:
        """The cache no longer holds these digests (scheduler thread; does not block)."""
        self._enqueue(("rem", digests))

    def reset(self) -> None:
        """The model changed: every digest published so far is void."""
        self._enqueue(("reset", []))

    def sync(self, timeout_s: float = PUBLISH_WAIT_S) -> bool:
        """Wait until every change enqueued before this call is written (or dropped on a Redis error), at
        most ``timeout_s`` s; False when the wait ran out, or at once when the writer does not run."""
        if not self._thread.is_alive():
            return False
        with self._progress:
            target = self._enqueued
            return self._progress.wait_for(lambda: self._settled >= target, timeout_s)

    def _enqueue(self, change: tuple[str, list[bytes]]) -> None:
        with self._progress:
            self._enqueued += 1
            self._changes.put(change)

    def refresh(self) -> None:
        """Extend the set's life by one TTL (heartbeat thread)."""
        with contextlib.suppress(redis.RedisError):
            self.client.expire(self.key, self.ttl_s)

    def stop(self) -> None:
        """Stop writing and delete the set."""
        self._changes.put(None)
        self._thread.join(5)
        with contextlib.suppress(redis.RedisError):
            self.client.delete(self.key)

    def _run(self) -> None:
        while True:
            first = self._changes.get()
            if first is None:
                return
            batch = [first]
            while True:
                try:
                    more = self._changes.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._write(batch)
                    return
                batch.append(more)
            self._write(batch)

    def _write(self, batch: list[tuple[str, list[bytes]]]) -> None:
        try:
            with self.client.pipeline(transaction=False) as pipe:
                for op, digests in batch:
                    if op == "reset":
                        pipe.delete(self.key)
                    elif op == "add":
                        pipe.sadd(self.key, *digests)
                    else:
                        pipe.srem(self.key, *digests)
                pipe.expire(self.key, self.ttl_s)
                pipe.execute()
            self.published += sum(len(d) for _, d in batch)
        except redis.RedisError as exc:
            log.warning("could not publish %d prefix-cache changes: %s", len(batch), exc)
        finally:
            with self._progress:
                self._settled += len(batch)
                self._progress.notify_all()
