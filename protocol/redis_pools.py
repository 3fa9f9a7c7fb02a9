"""redis-py connection pools that close the idle connections Redis closed, as soon as one is noticed.

When Redis restarts (or closes clients itself: ``CLIENT KILL``, its ``timeout``), every connection it
had is closed from its side. redis-py notices that only when it takes a connection out of its pool to
use it (``ensure_connection`` finds the socket at end of file and reconnects it), so each idle pooled
socket stays half-closed (``CLOSE_WAIT``, an fd held) until it is reused: up to the pool's peak size,
which for the gateway's asyncio pool is thousands. Measured before this module (a gateway after 200
concurrent long-polls, Redis restarted, one request served): 77 sockets to Redis in ``CLOSE_WAIT``
after the restart and 75 still there after the request.

The pools here do what redis-py does to the connection it took, to every idle one, the moment they
find one the server closed: each idle connection whose socket is at end of file (``can_read`` raises,
the check redis-py itself makes on reuse; no I/O on a live socket, nothing read from one) is
disconnected, so its fd is released now, and it reconnects when next used. Idle connections the server
did not close stay as they are. The check runs only when a taken connection turns out to have been
closed by the server (a restart, an outage), under the pool's lock, so no other caller takes a connection
while it runs; the commands' path is unchanged.

A pool notices only through its own use, and a worker has pools it rarely uses after a restart (the result
backend's, written to only when a result is stored: a worker that had served 24 requests kept 4 of 6 and 5 of 7
of its sockets to Redis half-closed after a restart and 4 heartbeats, until results were written again). So
every synchronous sweeping pool of the process is also listed (weakly) when made, and :func:`sweep_process_pools`
sweeps them all: the worker calls it after each heartbeat.

redis-py internals used (pinned in constraints.txt): a connection's transport (``_sock`` for the
synchronous connection, ``_writer`` for the asyncio one) to tell that ``ensure_connection`` replaced it,
and the pool's ``_lock`` and ``_available_connections``.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import redis
import redis.asyncio
import redis.asyncio.sentinel
import redis.sentinel

__all__ = [
    "AsyncClosedIdleSweep",
    "AsyncSweepingPool",
    "AsyncSweepingSentinelPool",
    "ClosedIdleSweep",
    "SweepingPool",
    "SweepingSentinelPool",
    "sweep_process_pools",
]

_CLOSED = (redis.ConnectionError, redis.TimeoutError, OSError)
"""What ``can_read`` raises for a connection the server closed (end of file, a reset)."""


def _transport(connection: Any) -> Any:
    """The connection's socket (synchronous) or stream writer (asyncio); None when it is not connected."""
    return getattr(connection, "_sock", None) or getattr(connection, "_writer", None)


_PROCESS_POOLS: weakref.WeakSet[ClosedIdleSweep] = weakref.WeakSet()
"""Every synchronous sweeping pool of this process that is still referenced (:func:`sweep_process_pools`)."""
_PROCESS_POOLS_LOCK = threading.Lock()


class ClosedIdleSweep:
    """Mixin for a synchronous ``redis.ConnectionPool``: see the module docstring."""

    swept_total = 0
    """Idle connections this pool disconnected because the server had closed them (for tests and logs)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        with _PROCESS_POOLS_LOCK:
            _PROCESS_POOLS.add(self)

    def ensure_connection(self, connection: Any) -> None:
        before = _transport(connection)
        try:
            super().ensure_connection(connection)  # type: ignore[misc]
        finally:
            if before is not None and _transport(connection) is not before:  # found closed, reconnected (or not)
                self.disconnect_closed_idle()

    def disconnect_closed_idle(self) -> int:
        """Disconnect every idle connection whose socket the server closed; returns how many."""
        swept = 0
        with self._lock:  # type: ignore[attr-defined]
            for connection in self._available_connections:  # type: ignore[attr-defined]
                if connection.is_connected and _closed_by_server(connection):
                    connection.disconnect()
                    swept += 1
            self.swept_total += swept
        return swept


def sweep_process_pools() -> int:
    """Disconnect the idle connections the server closed in every synchronous sweeping pool of this process
    (those used rarely included); returns how many. Each pool is swept under its own lock; a connection in use
    is not touched."""
    with _PROCESS_POOLS_LOCK:
        pools = list(_PROCESS_POOLS)
    return sum(pool.disconnect_closed_idle() for pool in pools)


def _closed_by_server(connection: Any) -> bool:
    try:
        connection.can_read()  # True: data waiting (a push, say), which the pool handles on reuse
    except _CLOSED:
        return True
    return False


class AsyncClosedIdleSweep:
    """Mixin for a ``redis.asyncio.ConnectionPool``: see the module docstring."""

    swept_total = 0
    """Idle connections this pool disconnected because the server had closed them (for tests and logs)."""

    async def ensure_connection(self, connection: Any) -> None:
        before = _transport(connection)
        try:
            await super().ensure_connection(connection)  # type: ignore[misc]
        finally:
            if before is not None and _transport(connection) is not before:
                await self.disconnect_closed_idle()

    async def disconnect_closed_idle(self) -> int:
        """Disconnect every idle connection whose socket the server closed; returns how many.

        The asyncio parser's ``can_read`` looks at what the event loop already received (end of file, an
        error), without reading or waiting."""
        swept = 0
        async with self._lock:  # type: ignore[attr-defined]
            for connection in list(self._available_connections):  # type: ignore[attr-defined]
                if not connection.is_connected:
                    continue
                try:
                    await connection.can_read()
                except _CLOSED:
                    await connection.disconnect(nowait=True)
                    swept += 1
            self.swept_total += swept
        return swept


class SweepingPool(ClosedIdleSweep, redis.ConnectionPool):
    """``redis.ConnectionPool`` that disconnects the idle connections the server closed (module docstring)."""


class SweepingSentinelPool(ClosedIdleSweep, redis.sentinel.SentinelConnectionPool):
    """The same, for a Sentinel-managed master."""


class AsyncSweepingPool(AsyncClosedIdleSweep, redis.asyncio.ConnectionPool):  # type: ignore[type-arg]
    """``redis.asyncio.ConnectionPool`` that disconnects the idle connections the server closed."""


class AsyncSweepingSentinelPool(AsyncClosedIdleSweep, redis.asyncio.sentinel.SentinelConnectionPool):  # type: ignore[type-arg]
    """The same, for a Sentinel-managed master."""
