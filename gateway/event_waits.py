"""Waiting for an ``asyncio.Event`` with a bound, without ``asyncio.wait_for``.

``wait_for`` runs the wait in a task of its own: a Task created and scheduled for every result wait's
pause, every subscription's confirmation and every stream read's rejoin, on the gateway's one event
loop. On Python 3.11 it can also swallow a cancel that arrives as the wait completes (CPython
gh-86296; :mod:`gateway.cancelling`). ``asyncio.timeout`` cancels the waiting coroutine itself: no
task, and a cancel from outside stays a cancel.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

__all__ = ["all_set_within", "set_within"]


async def set_within(event: asyncio.Event, timeout_s: float) -> bool:
    """Whether ``event`` is set within ``timeout_s`` seconds (True at once when it already is)."""
    return await all_set_within((event,), timeout_s)


async def all_set_within(events: Iterable[asyncio.Event], timeout_s: float) -> bool:
    """Whether every one of ``events`` is set within ``timeout_s`` seconds, all told."""
    pending = [event for event in events if not event.is_set()]
    if not pending:
        return True
    try:
        async with asyncio.timeout(timeout_s):
            for event in pending:
                await event.wait()
    except TimeoutError:
        return False
    return True
