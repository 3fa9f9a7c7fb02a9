"""A non-streaming call whose HTTP client leaves: stop waiting, and cancel what it asked for.

Starlette cancels a *streaming* response when its client disconnects (:mod:`gateway.sse`), but a plain
endpoint awaiting a result goes on waiting, and the request it queued (a generation of hundreds of
tokens) goes on running for nobody. :func:`unless_client_leaves` races the wait against the client's
``http.disconnect`` (the body was read already, so the next ASGI message is that one) and, when the
client wins, cancels the wait and runs ``on_leave`` (the OpenAI routes mark the request cancelled).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request

from gateway.cancelling import cancel_and_wait

__all__ = ["ClientLeft", "client_left", "unless_client_leaves"]

T = TypeVar("T")


class ClientLeft(Exception):
    """The HTTP client disconnected before the answer was ready."""


async def client_left(request: Request) -> None:
    """Return once the client of ``request`` (whose body was read) disconnects."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_client_leaves(request: Request, work: Awaitable[T], on_leave: Callable[[], Awaitable[None]]) -> T:
    """``await work``, unless the client disconnects first: then ``work`` is cancelled, ``on_leave()``
    is awaited (shielded from a cancellation of this call) and :class:`ClientLeft` raised."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(client_left(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        left = not task.done()
        watch.cancel()
        if left:  # until it has ended: a single cancel can be swallowed (gateway.cancelling)
            await cancel_and_wait(task)
    if left:
        await asyncio.shield(on_leave())
        raise ClientLeft
    return task.result()
