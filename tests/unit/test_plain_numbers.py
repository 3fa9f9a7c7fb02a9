"""Numbers in the gateway's query strings and headers are ASCII digits (:mod:`gateway.plain_numbers`): ``float()``
and ``int()`` read ``1_0`` as 10, ``١٠`` (Arabic-Indic digits) as 10, `` 1e1`` as 10, ``+5`` as 5, ``inf``.

Reported: ``Prefer: wait=1_0`` waited 10 s; ``?wait_s=1_0``, ``?wait_s=+1``, ``?wait_s=-0`` and the Responses API's
``?limit=1_0`` were taken (pydantic's lax parsing of a string); the body guard read ``Content-Length: 1_0`` as 10.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from gateway.middleware import BodyLimitMiddleware
from gateway.plain_numbers import is_plain_count, plain_seconds
from gateway.prefer import prefer_wait_s

LENIENT = ["1_0", "١٠", " 1e1", "1e1", "+5", "-0", "inf", "Infinity", "nan", "0x10", "1.", ".5", "1.5.0", "", "10 s"]
"""What ``float()`` (or pydantic) read, or what is no number at all; none is digits with an optional fraction."""


@pytest.mark.parametrize(("text", "seconds"), [("0", 0.0), ("10", 10.0), ("2.5", 2.5), ("007", 7.0)])
def test_seconds_are_digits_with_an_optional_fraction(text: str, seconds: float) -> None:
    assert plain_seconds(text) == seconds


@pytest.mark.parametrize("text", LENIENT)
def test_what_float_reads_beyond_digits_is_not_seconds(text: str) -> None:
    assert plain_seconds(text) is None


@pytest.mark.parametrize("text", [*LENIENT, "2.5", "٢"])
def test_a_count_is_digits_only(text: str) -> None:
    assert not is_plain_count(text) and not is_plain_count(text.encode())
    assert is_plain_count("20") and is_plain_count(b"4096")


@pytest.mark.parametrize("value", ["1_0", "١٠", " 1e1", "1e1", "+5", "inf", "nan", "1.", '""10', '"1_0"'])
def test_a_prefer_wait_that_is_not_digits_is_unreadable(value: str) -> None:
    """Before: ``float()`` read ``wait=1_0``, ``wait= 1e1`` and ``wait=١٠`` as 10 s (and ``""10`` as 10: every
    quote stripped)."""
    assert prefer_wait_s(f"wait={value}") is None
    assert prefer_wait_s(f"respond-async, wait={value}") is None


@pytest.mark.parametrize(("header", "seconds"), [('wait="2.5"', 2.5), ("wait=\t3", 3.0), ("Wait = 10 ;x=y", 10.0)])
def test_a_prefer_wait_may_be_quoted_or_spaced(header: str, seconds: float) -> None:
    assert prefer_wait_s(header) == seconds


@pytest.mark.parametrize("declared", [b"1_0", b"+5", b"-1", b" 5"])
def test_a_content_length_that_is_not_digits_is_refused(declared: bytes) -> None:
    """The HTTP parser (llhttp) refuses these first; the middleware no longer relies on it (``int(b"1_0")`` is 10,
    ``int(b"-1")`` passed the byte cap)."""
    sent: list[dict[str, Any]] = []
    ran: list[bool] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        ran.append(True)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/requests",
             "headers": [(b"content-type", b"application/json"), (b"content-length", declared)]}  # fmt: skip
    asyncio.run(BodyLimitMiddleware(app, max_bytes=4096)(scope, receive, send))
    assert not ran and sent[0]["status"] == 400, sent
    body = json.loads(sent[1]["body"])
    assert body["field"] == "Content-Length" and body["message"] == "Content-Length is not an integer", body
