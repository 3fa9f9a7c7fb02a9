"""The gateway sweeps its Redis pools every :data:`SWEEP_INTERVAL_S` seconds, used or not.

A sweeping pool (:mod:`protocol.redis_pools`) releases the sockets Redis closed (a restart: each one
half-closed, ``CLOSE_WAIT``, an fd held) when it finds one of them closed, which it does only through its own
use. A gateway idle across a Redis restart kept them in every pool until its next request: up to the asyncio
pool's peak size (its long-polls', thousands at most). A worker sweeps its pools after each heartbeat; the
gateway has no heartbeat, so a task of its event loop (started and stopped by the app's lifespan) sweeps the
asyncio pools it is given on the loop that owns them, then every synchronous sweeping pool of the process
(:func:`protocol.redis_pools.sweep_process_pools`, in a thread: it takes their locks). A sweep costs a
non-blocking check per idle connection and touches no connection in use.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

from protocol.redis_pools import AsyncClosedIdleSweep, sweep_process_pools

__all__ = ["SWEEP_INTERVAL_S", "PoolSweeper"]

log = logging.getLogger("fleet.api")

SWEEP_INTERVAL_S = 5.0
"""Seconds between two sweeps: how long a socket Redis closed may stay half-closed in an idle gateway."""


class PoolSweeper:
    """Sweeps ``pools`` (asyncio, of the running loop) and the process's synchronous pools every ``interval_s``
    seconds between :meth:`start` and :meth:`aclose`."""

    def __init__(self, pools: Sequence[object], interval_s: float = SWEEP_INTERVAL_S) -> None:
        self.pools = [pool for pool in pools if isinstance(pool, AsyncClosedIdleSweep)]
        """The sweeping ones among ``pools`` (a plain redis-py pool has nothing to sweep with)."""
        self.interval_s = interval_s
        self.sweeps = 0
        """Sweeps completed."""
        self.released_total = 0
        """Connections the sweeps disconnected because Redis had closed them."""
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start sweeping on the running event loop (call from it, once)."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="redis-pool-sweeper")

    async def aclose(self) -> None:
        """Stop sweeping; waits for a sweep under way to be cancelled."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def sweep_once(self) -> int:
        """One sweep of every pool; returns how many connections it released."""
        released = 0
        for pool in self.pools:
            released += await pool.disconnect_closed_idle()
        released += await asyncio.to_thread(sweep_process_pools)
        self.sweeps += 1
        self.released_total += released
        return released

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)  # a period, not a wait for another task
            try:
                released = await self.sweep_once()
            except Exception as exc:  # a sweep that failed must not end the sweeping
                log.warning("sweeping the gateway's Redis pools failed: %s", exc)
                continue
            if released:
                log.info("released %d connection(s) to Redis that Redis had closed", released)
