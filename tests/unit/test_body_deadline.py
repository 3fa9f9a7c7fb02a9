"""The deadline on reading a request body (:class:`gateway.middleware.BodyLimitMiddleware`, ``api.body_timeout_s``),
as pure ASGI: a body that stops short is answered 408 naming ``body`` and the limit, in the route's shape, with
``Connection: close``, and the app never runs; a body that arrives whole is handed on as before. And the refusal
past ``api.max_concurrent_requests`` closes a connection whose body it leaves unread."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from gateway.concurrency_cap import ConcurrencyCapMiddleware
from gateway.middleware import BodyLimitMiddleware

TIMEOUT_S = 0.05
"""The deadline here (s): the stalled receive below never returns, so only the deadline ends the read."""


def _scope(path: str, framing: tuple[bytes, bytes] | None) -> dict[str, Any]:
    headers = [(b"content-type", b"application/json"), *([framing] if framing else [])]
    return {"type": "http", "method": "POST", "path": path, "headers": headers}


def _call(mw: Any, scope: dict[str, Any], chunks: list[bytes], stall: bool) -> tuple[list[dict[str, Any]], list[bytes]]:
    """Run ``mw`` on ``chunks`` of body (then a receive that never returns when ``stall``); what it sent, and what
    the app behind it was handed."""
    sent: list[dict[str, Any]] = []
    handed: list[bytes] = []

    async def run() -> None:
        pending = list(chunks)

        async def receive() -> dict[str, Any]:
            if pending:
                body = pending.pop(0)
                return {"type": "http.request", "body": body, "more_body": stall or bool(pending)}
            await asyncio.Event().wait()  # the client sends nothing more, and keeps the socket open
            raise AssertionError("unreachable")

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await mw(scope, receive, send)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        handed.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    mw.app = app
    asyncio.run(asyncio.wait_for(run(), 30))
    return sent, handed


@pytest.mark.parametrize(
    ("path", "framing", "chunks"),
    [
        ("/v1/chat/completions", (b"content-length", b"200"), [b'{"model":']),
        ("/v1/requests", (b"content-length", b"200"), [b'{"model":']),
        ("/v1/requests", (b"transfer-encoding", b"chunked"), [b'{"mod', b'el":']),
        ("/v1/requests", (b"content-length", b"200"), []),  # the head came, and not a byte of body
    ],
)
def test_a_body_that_stops_short_is_answered_408_and_the_connection_closed(
    path: str, framing: tuple[bytes, bytes], chunks: list[bytes]
) -> None:
    mw = BodyLimitMiddleware(None, max_bytes=4096, timeout_s=TIMEOUT_S)  # type: ignore[arg-type]
    sent, handed = _call(mw, _scope(path, framing), chunks, stall=True)
    assert handed == []  # the app never ran
    assert sent[0]["status"] == 408
    headers = dict(sent[0]["headers"])
    assert headers[b"connection"] == b"close"
    body = json.loads(sent[1]["body"])
    received = sum(map(len, chunks))
    if path == "/v1/requests":
        assert (body["error"], body["field"], body["limit"]) == ("request_timeout", "body", TIMEOUT_S)
        message = body["message"]
    else:  # OpenAI's shape on OpenAI's routes
        assert (body["error"]["code"], body["error"]["param"]) == ("request_timeout", "body")
        message = body["error"]["message"]
    assert f"({received} bytes received)" in message and f"api.body_timeout_s={TIMEOUT_S:g}" in message, message


def test_a_whole_body_is_handed_on_and_the_byte_cap_still_holds() -> None:
    mw = BodyLimitMiddleware(None, max_bytes=16, timeout_s=TIMEOUT_S)  # type: ignore[arg-type]
    sent, handed = _call(mw, _scope("/v1/requests", (b"transfer-encoding", b"chunked")), [b'{"a":', b"1}"], False)
    assert handed == [b'{"a":1}'] and sent[0]["status"] == 200
    sent, handed = _call(mw, _scope("/v1/requests", (b"transfer-encoding", b"chunked")), [b"x" * 10] * 2, False)
    assert handed == [] and sent[0]["status"] == 413 and json.loads(sent[1]["body"])["limit"] == 16
    sent, handed = _call(mw, _scope("/healthz", None), [b""], False)  # no body declared: none awaited
    assert handed == [b""] and sent[0]["status"] == 200


class _Counts:
    """The gateway's metrics as the cap keeps them, with one request already being answered."""

    def __init__(self) -> None:
        self.in_progress = 1
        self.overloaded = self

    def inc(self) -> None:
        """A refusal counted."""


@pytest.mark.parametrize(("framing", "closed"), [((b"content-length", b"200"), True), (None, False)])
def test_a_refusal_past_the_cap_closes_a_connection_whose_body_it_leaves_unread(
    framing: tuple[bytes, bytes] | None, closed: bool
) -> None:
    """Before: the 503 kept the connection open; uvicorn read the unread body on and dropped it, with no timer,
    so a body that trickled held the connection for ever."""
    cap = ConcurrencyCapMiddleware(None, 1, _Counts())  # type: ignore[arg-type]
    sent, _ = _call(cap, _scope("/v1/requests", framing), [], stall=True)
    headers = dict(sent[0]["headers"])
    assert sent[0]["status"] == 503 and headers[b"retry-after"] == b"1"
    assert (headers.get(b"connection") == b"close") is closed, headers
