"""Ending a task for good: cancel it again while it goes on.

On Python 3.11, ``asyncio.wait_for`` swallows a cancel that arrives as the awaitable it wraps completes
(CPython gh-86296, fixed in 3.12), and redis-py 8.2 wraps a command's write in ``wait_for`` when the
client has a socket timeout: a task cancelled at that instant goes on as if nothing happened. A relay
whose read task was cancelled once then read on for its whole silence bound (600 s), and its caller,
waiting for the task to end, hung with it (a no-worker stream that never sent its error chunk:
about 1 run in 8 of tests/integration/test_no_worker.py). :func:`cancel_and_wait` cancels, waits a
little, and cancels again until the task has ended.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["CANCEL_AGAIN_S", "cancel_and_wait"]

CANCEL_AGAIN_S = 0.05
"""How long a cancelled task has to end before it is cancelled again (s)."""


async def cancel_and_wait(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` and return once it has ended (cancelled, or finished if it was about to), cancelling
    it again every :data:`CANCEL_AGAIN_S` while it goes on. Its exception, if any, is marked retrieved."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=CANCEL_AGAIN_S)
    if not task.cancelled():
        task.exception()  # retrieved: the caller cancelled it and does not want its outcome
