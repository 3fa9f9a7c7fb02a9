"""Bounds on a connection: its request head (request line and headers) in bytes, header count and time,
and how long its client may leave a response unread.

uvicorn's httptools protocol keeps every byte of the request line and every header until the head
ends, with no bound in bytes, count or time, before any middleware or route runs (so before the API
key is looked at): one connection sending 50 MB of ``X-A: b`` lines took a gateway from 138 MB to
835 MB, and a connection that opens and then sends nothing, or half a head, was held for ever (a file
descriptor and a protocol object each, until the process can accept no more). :class:`BoundedHeadProtocol`
is that protocol with three bounds, checked as the bytes arrive:

* at most :data:`MAX_HEAD_BYTES` received while a head is incomplete (counted per socket read, judged once
  the parser has seen it: a read that completes the head, body bytes and all, is never refused), else
  ``431`` naming ``headers`` and the limit;
* at most :data:`MAX_HEADERS` header lines (Apache's ``LimitRequestFields``), else ``431``;
* a head complete within :data:`HEAD_TIMEOUT_S` of the moment the connection waits for one (opened, or
  its previous response sent), else the connection is closed (``408`` when part of a head came).
  A request being answered (a long-poll, a stream) is never timed: only the wait for a head is.

A refusal is JSON in the gateway's error shape (OpenAI's on the OpenAI routes) and closes the
connection. Bodies are bounded elsewhere (:mod:`gateway.body_guard`, after the key is checked).

A response whose client stops reading fills the socket's buffers, then the transport's (64 KiB), and its
writer then waits for the client for ever: a stalled stream reader held its connection, its relay and
its generation (run to the end for nobody) as long as the client kept the socket open. A connection whose
writes have been held up for :attr:`ConnectionLimits.write_stall_s` is aborted (a warning names the
client); the route sees the disconnect as it sees any other (a stream's request is cancelled).

The bounds are :class:`ConnectionLimits` (the ``api`` settings give them): :func:`bounded_protocol`
makes the protocol class for ``uvicorn.run(http=...)``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any, ClassVar
from urllib.parse import urlsplit

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.errors import error_payload, is_openai_path, openai_error

__all__ = [
    "HEAD_TIMEOUT_S", "MAX_HEADERS", "MAX_HEAD_BYTES", "WRITE_STALL_S", "BoundedHeadProtocol", "ConnectionLimits",
    "bounded_protocol",
]  # fmt: skip

log = logging.getLogger("fleet.api")

MAX_HEAD_BYTES = 65_536
"""Most bytes of one request line and its headers (nginx's large header buffers hold 4 x 8 KiB)."""
MAX_HEADERS = 100
"""Most header lines of one request (Apache's ``LimitRequestFields`` default)."""
HEAD_TIMEOUT_S = 10.0
"""How long a connection may take to send a whole request head once the server waits for one (s)."""
WRITE_STALL_S = 60.0
"""How long a response's writes may wait for its client to read before the connection is aborted (s; nginx's
``send_timeout`` is 60 s)."""


@dataclass(frozen=True)
class ConnectionLimits:
    """The bounds :class:`BoundedHeadProtocol` keeps (see the module)."""

    head_bytes: int = MAX_HEAD_BYTES
    """Most bytes of a request line and its headers."""
    headers: int = MAX_HEADERS
    """Most header lines of one request."""
    head_timeout_s: float = HEAD_TIMEOUT_S
    """Time to send a whole head once the server waits for one (s)."""
    write_stall_s: float = WRITE_STALL_S
    """Time a response's writes may stay held up by a client that does not read (s)."""

_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


class _HeadRefused(Exception):
    """Raised from a parser callback to stop the parser; uvicorn then answers through ``send_400_response``."""


class BoundedHeadProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds of the module docstring (``uvicorn.run(http=...)``)."""

    limits: ClassVar[ConnectionLimits] = ConnectionLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_open = True
        """Whether the parser is inside a head, or waiting for the next one."""
        self._head_bytes = 0
        self._head_lines = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._stall_timer: asyncio.TimerHandle | None = None
        self._refusal: tuple[int, dict[str, Any]] | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._time_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timing()
        self._stop_stall_timer()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_timer is None:
            self._stall_timer = self.loop.call_later(self.limits.write_stall_s, self._write_stalled)

    def resume_writing(self) -> None:
        self._stop_stall_timer()
        super().resume_writing()

    def data_received(self, data: bytes) -> None:
        if self._refusal is not None:
            return
        counting = self._head_open
        if counting:
            self._head_bytes += len(data)
        super().data_received(data)
        # judged after the parser saw the read: a read that ends the head may carry much of the body too (a
        # 70 KB body sent with its head came in one read and was refused as a 431 before)
        limit = self.limits.head_bytes
        if counting and self._head_open and self._head_bytes > limit and self._refusal is None:
            what = f"the request line and headers exceed {limit} bytes"
            self._refuse(431, "headers_too_large", f"{what}; the limit is {limit} bytes", limit)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_open = True

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_lines += 1
        limit = self.limits.headers
        if self._head_lines > limit:
            msg = f"the request has more than {limit} header lines; the limit is {limit}"
            self._refusal = (431, self._payload("too_many_headers", msg, limit))
            raise _HeadRefused  # stops the parser: uvicorn answers through send_400_response
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._head_open = False
        self._stop_timing()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._head_open, self._head_bytes, self._head_lines = True, 0, 0

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and not self.pipeline:  # idle: the next head is awaited now
            self._time_head()

    def send_400_response(self, msg: str) -> None:
        if self._refusal is None:
            super().send_400_response(msg)
            return
        status, payload = self._refusal
        self._answer(status, payload)

    # -- the bounds ------------------------------------------------------------------------------
    def _time_head(self) -> None:
        self._stop_timing()
        self._head_timer = self.loop.call_later(self.limits.head_timeout_s, self._head_timed_out)

    def _stop_timing(self) -> None:
        _cancel(self._head_timer)
        self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._head_open:
            return
        if self._head_bytes == 0:  # nothing came: closed as an idle keep-alive connection is
            self.transport.close()
            return
        limit = self.limits.head_timeout_s
        msg = f"the request head was not complete within {limit:g} s; the limit is {limit:g} s"
        self._refuse(408, "request_timeout", msg, limit)

    def _stop_stall_timer(self) -> None:
        _cancel(self._stall_timer)
        self._stall_timer = None

    def _write_stalled(self) -> None:
        """The client took no bytes for ``write_stall_s``: abort, so the response's writer stops waiting."""
        self._stall_timer = None
        if self.transport.is_closing():
            return
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        log.warning(
            "aborted the connection of %s: its response waited %g s for the client to read (api.write_stall_s)",
            client, self.limits.write_stall_s,
        )  # fmt: skip
        self.transport.abort()

    def _refuse(self, status: int, code: str, message: str, limit: float) -> None:
        self._refusal = (status, self._payload(code, message, limit))
        self._answer(*self._refusal)

    def _payload(self, code: str, message: str, limit: float) -> dict[str, Any]:
        kind = "RequestTimeout" if code == "request_timeout" else "RequestHeaderFieldsTooLarge"
        return error_payload(code, kind, message, "headers", limit)

    def _answer(self, status: int, payload: dict[str, Any]) -> None:
        """Write ``payload`` as the response (in OpenAI's shape on its routes) and close the connection."""
        self._stop_timing()
        if self.transport.is_closing():
            return
        url: bytes = getattr(self, "url", b"")  # set once a request line begins
        try:
            path = urlsplit(url.decode("latin-1")).path
        except ValueError:  # not a URL
            path = ""
        body = json.dumps(openai_error(status, payload) if is_openai_path(path) else payload).encode()
        head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
        self.transport.write(head % (status, _REASONS[status], len(body)) + body)
        self.transport.close()


def _cancel(timer: asyncio.TimerHandle | None) -> None:
    """Cancel ``timer`` if there is one."""
    if timer is not None:
        timer.cancel()


def bounded_protocol(limits: ConnectionLimits) -> type[BoundedHeadProtocol]:
    """:class:`BoundedHeadProtocol` keeping ``limits``: the class to pass as ``uvicorn.run(http=...)``."""
    return type("BoundedHeadProtocol", (BoundedHeadProtocol,), {"limits": limits})
