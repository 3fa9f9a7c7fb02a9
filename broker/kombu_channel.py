"""kombu's Redis channel, minus a ``redis.Redis`` object built for every command it sends.

kombu's Redis channel sends each ``LPUSH`` (a task), each ``PUBLISH`` (a task event), each ack's
pipeline and each unacked-bookkeeping pipeline through ``conn_or_acquire()``, which builds a new
``redis.Redis`` client on the channel's connection pool every time. The pool (the sockets) is
shared, but building the client copies its table of response callbacks: ``fleet bench`` with
py-spy put that at 10–12 % of the worker's and of the producer's CPU on the ``fleet.infer`` path.

:class:`ReusesSyncClient` keeps one synchronous client per channel and pool instead. A
``redis.Redis`` that is not a single-connection client takes a connection from its pool for each
command (pipelines hold one for their ``execute``), so one client is safe to share between the
threads that share the channel. A new pool (kombu drops it on a reconnect) gets a new client.
The asynchronous client (``BRPOP``, the poller's own connection) is kombu's, untouched.

:class:`PlainPipelineQoS` sends kombu's two per-delivery bookkeeping writes (``ZADD``+``HSET`` when a
message is taken, ``HDEL``+``ZREM`` when it is acked) as plain pipelines instead of ``MULTI``/``EXEC``
transactions: the same one round trip, 2 commands instead of 4 each time (4 of the ~21 commands a
``fleet.infer`` request costs). Atomicity buys nothing there: a message's index entry is only read
by the restore scan once it is older than the visibility timeout, long after both writes of the
take landed; and the ack removes the hash entry first, which is the key kombu's restore WATCHes, so
a restore racing an ack either sees the entry gone or has its transaction aborted, as before.
Restores (``restore_by_tag``) keep kombu's WATCH/MULTI transaction.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kombu.transport import redis as kombu_redis

__all__ = ["FleetChannel", "FleetSentinelChannel", "PlainPipelineQoS", "ReusesSyncClient", "install"]


class ReusesSyncClient:
    """Mixin for a kombu Redis channel: one synchronous ``redis.Redis`` per connection pool."""

    _reused_client: tuple[Any, Any] | None = None
    """(pool, client) of the last synchronous client built; rebuilt when the pool changes."""

    def _create_client(self, asynchronous: bool = False) -> Any:
        if asynchronous:
            return super()._create_client(asynchronous=True)  # type: ignore[misc]
        pool = self.pool  # type: ignore[attr-defined]
        cached = self._reused_client
        if cached is not None and cached[0] is pool:
            return cached[1]
        client = super()._create_client(asynchronous=False)  # type: ignore[misc]
        self._reused_client = (pool, client)
        return client


class PlainPipelineQoS(kombu_redis.QoS):
    """kombu's ack emulation; a delivery's take and ack are plain pipelines (see the module doc)."""

    @contextmanager
    def pipe_or_acquire(self, pipe: Any = None, client: Any = None) -> Iterator[Any]:
        if pipe is not None:
            yield pipe
            return
        with self.channel.conn_or_acquire(client) as acquired:
            yield acquired.pipeline(transaction=False)

    def _remove_from_indices(self, delivery_tag: Any, pipe: Any = None) -> Any:
        with self.pipe_or_acquire(pipe) as p:  # the hash entry first: restore_by_tag WATCHes that key
            return p.hdel(self.unacked_key, delivery_tag).zrem(self.unacked_index_key, delivery_tag)


class FleetChannel(ReusesSyncClient, kombu_redis.Channel):
    """kombu's Redis channel with one reused synchronous client and plain-pipeline bookkeeping
    (producers, the gateway, Flower's broker)."""

    QoS = PlainPipelineQoS


class FleetSentinelChannel(ReusesSyncClient, kombu_redis.SentinelChannel):
    """kombu's Sentinel channel, the same way, per (failover-managed) pool."""

    QoS = PlainPipelineQoS


def install() -> None:
    """Make kombu's Redis and Sentinel transports in this process use these channels, unless a
    channel that already reuses its client (the worker's :class:`broker.poison.GuardedChannel`) is
    installed."""
    for transport, channel in ((kombu_redis.Transport, FleetChannel),
                               (kombu_redis.SentinelTransport, FleetSentinelChannel)):  # fmt: skip
        current = transport.Channel
        if not (isinstance(current, type) and issubclass(current, ReusesSyncClient)):
            transport.Channel = channel
