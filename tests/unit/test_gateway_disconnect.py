"""``gateway.disconnect``: the race between a call's wait and its client's ``http.disconnect`` (pure asyncio)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.disconnect import ClientLeft, unless_client_leaves


class _Request:
    """What ``unless_client_leaves`` reads of a Starlette request: ``receive()``, here fed by the test."""

    def __init__(self) -> None:
        self.messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def receive(self) -> dict[str, Any]:
        return await self.messages.get()


def test_the_answer_wins_when_it_is_ready_first() -> None:
    async def run() -> tuple[str, list[str]]:
        request, left = _Request(), []

        async def leave() -> None:
            left.append("left")

        async def answer() -> str:
            await asyncio.sleep(0.01)
            return "answer"

        return await unless_client_leaves(request, answer(), leave), left  # type: ignore[arg-type]

    assert asyncio.run(run()) == ("answer", [])


def test_a_client_that_leaves_cancels_the_wait_and_runs_on_leave_once() -> None:
    async def run() -> tuple[list[str], bool]:
        request, left = _Request(), []
        waiting = asyncio.Event()

        async def leave() -> None:
            left.append("left")

        async def answer() -> str:
            waiting.set()
            await asyncio.sleep(60)
            return "never"

        work = asyncio.ensure_future(answer())
        call = asyncio.ensure_future(unless_client_leaves(request, work, leave))  # type: ignore[arg-type]
        await waiting.wait()
        await request.messages.put({"type": "http.disconnect"})
        with pytest.raises(ClientLeft):
            await call
        await asyncio.sleep(0)
        return left, work.cancelled()

    assert asyncio.run(run()) == (["left"], True)
