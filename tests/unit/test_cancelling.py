"""A cancel swallowed once (Python 3.11's ``asyncio.wait_for`` does that when its awaitable completes at the
same instant: CPython gh-86296) must not leave a task running, or its caller waiting, for good."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace

from gateway.cancelling import cancel_and_wait
from gateway.outcomes import relay_unless_no_worker
from protocol.errors import NoLiveWorker
from protocol.settings import load_settings


async def _swallows_one_cancel(swallowed: list[int]) -> str:
    """Waits for ever, going on after the first cancel as a task inside such a wait_for does."""
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if swallowed:
                raise
            swallowed.append(1)


def test_cancel_and_wait_ends_a_task_that_swallowed_a_cancel() -> None:
    async def main() -> None:
        swallowed: list[int] = []
        task = asyncio.ensure_future(_swallows_one_cancel(swallowed))
        await asyncio.sleep(0)
        ending = asyncio.ensure_future(cancel_and_wait(task))
        await asyncio.wait({ending}, timeout=30)  # a bound that fails the test, not a wait
        assert ending.done() and task.cancelled() and swallowed == [1]

    asyncio.run(main())


def test_cancel_and_wait_keeps_a_finished_task_and_retrieves_its_error() -> None:
    async def fails() -> None:
        raise ValueError("boom")

    async def main() -> None:
        task = asyncio.ensure_future(fails())
        await asyncio.wait({task})
        await cancel_and_wait(task)
        assert isinstance(task.exception(), ValueError)

    asyncio.run(main())


class _NoWorker:
    async def has_worker(self, model: str) -> bool:
        return False


async def _silent_events(swallowed: list[int]) -> AsyncIterator[list[object]]:
    """A stream that never gets an event, whose read swallows the first cancel."""
    await _swallows_one_cancel(swallowed)
    yield []


def test_the_no_worker_bound_ends_a_relay_whose_read_swallowed_the_cancel() -> None:
    """Before, the relay cancelled its read once and waited for it: with the cancel swallowed, the
    no-worker error never came and the client's stream hung."""
    fleet = SimpleNamespace(settings=load_settings(None, models={"m": {"path": "/nonexistent.onnx"}}))

    async def main() -> None:
        swallowed: list[int] = []
        relay = relay_unless_no_worker(_silent_events(swallowed), fleet, _NoWorker(), "m", wait_s=0.05)  # type: ignore[arg-type]
        first = asyncio.ensure_future(relay.__anext__())
        await asyncio.wait({first}, timeout=30)  # a bound that fails the test, not a wait: the relay ends at once
        assert first.done(), "the relay still waits for its read"
        error = first.exception()
        assert isinstance(error, NoLiveWorker) and error.field == "model" and swallowed == [1]

    asyncio.run(main())
