"""Server-Sent Events responses that notice when the client leaves.

:class:`EventStream` is a ``text/event-stream`` response whose body is an async iterator of frames
(:func:`sse_frame`). When the response ends before ``finished()`` says the stream is complete — the
client disconnected, or the server is shutting down — it awaits ``on_abort`` once, shielded from the
cancellation that ended the stream (the OpenAI routes cancel the request there).

With uvicorn's HTTP protocols (ASGI spec 2.3) Starlette listens for ``http.disconnect`` beside the
body and cancels the body at once, so a reader blocked in ``XREAD BLOCK`` stops at the disconnect,
not at its next write.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

__all__ = ["DONE_FRAME", "EventStream", "sse_frame"]

DONE_FRAME = b"data: [DONE]\n\n"
"""OpenAI's end-of-stream frame."""


def sse_frame(payload: Any) -> bytes:
    """One ``data:`` frame of ``payload`` as compact JSON."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class EventStream(StreamingResponse):
    """An SSE response that runs ``on_abort`` when it ends before ``finished()`` is true (default: never)."""

    def __init__(
        self,
        frames: AsyncIterator[bytes],
        *,
        finished: Callable[[], bool] = lambda: True,
        on_abort: Callable[[], Awaitable[None]] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        # no-cache, and no buffering in nginx-like proxies: each frame must leave at once
        sse_headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})}
        super().__init__(frames, media_type="text/event-stream", headers=sse_headers)
        self._frames = frames
        self._finished = finished
        self._on_abort = on_abort

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                close = getattr(self._frames, "aclose", None)
                if close is not None:
                    await close()  # a body left suspended at a frame gives back its Redis connection now
                if not self._finished() and self._on_abort is not None:
                    await self._on_abort()
