"""gateway.event_waits: a bounded wait for events without a task per wait, and a cancel stays a cancel."""

from __future__ import annotations

import asyncio

import pytest

from gateway.event_waits import all_set_within, set_within


def test_an_event_set_before_or_during_the_wait_is_seen() -> None:
    async def main() -> None:
        ready = asyncio.Event()
        ready.set()
        assert await set_within(ready, 0.0)
        later = asyncio.Event()
        asyncio.get_running_loop().call_soon(later.set)
        assert await set_within(later, 60.0)

    asyncio.run(main())


def test_the_bound_ends_the_wait_with_false() -> None:
    async def main() -> None:
        assert not await set_within(asyncio.Event(), 0.01)
        done, never = asyncio.Event(), asyncio.Event()
        done.set()
        assert not await all_set_within([done, never], 0.01)
        assert await all_set_within([done], 0.0)

    asyncio.run(main())


def test_a_cancel_that_arrives_as_the_event_is_set_stays_a_cancel() -> None:
    """asyncio.wait_for on Python 3.11 can swallow such a cancel (CPython gh-86296): the waiting task went
    on as if nothing happened."""

    async def main() -> None:
        event = asyncio.Event()
        waiting = asyncio.create_task(set_within(event, 60.0))
        await asyncio.sleep(0)  # the task waits on the event now
        event.set()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting

    asyncio.run(main())
