"""A request body is bounded in time: one not complete within ``api.body_timeout_s`` of the moment the gateway
reads it is answered ``408`` naming ``body`` and the limit (in the route's error shape), and its connection is
closed, so it gives back its slot of ``api.max_concurrent_requests``. A real ``fleet api`` process, raw sockets
(no HTTP client stops a body short on purpose).

Before: a body that stopped short (headers, ``Content-Length: 200``, then ``{"model":``) was never answered and
held its connection and its slot for as long as the client kept the socket open; with the cap at 4, four such
sockets made every other request (``/v1/models`` too) a ``503 overloaded``.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.integration.ops_fixtures import (
    API_KEY,
    GatewayProcess,
    closing_answer,
    lone_gateway,
    ops_models,
    ops_redis,
    scrape,
    wait_until,
)
from tools.redis_server import EmbeddedRedis

__all__ = ["ops_models", "ops_redis"]

BODY_TIMEOUT_S = 1.0
"""The gateway's ``api.body_timeout_s`` here (s)."""
CAP = 4
"""The gateway's ``api.max_concurrent_requests`` here: as many as the stalled bodies sent at once."""
ANSWER_S = 60.0
"""How long a socket waits for the gateway's answer (s): far past the bound, so only a missing answer fails."""
HEAD = ("POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json\r\n"
        "{framing}\r\n")


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, ops_models: Any, ops_redis: EmbeddedRedis
) -> Iterator[GatewayProcess]:
    api = {"body_timeout_s": BODY_TIMEOUT_S, "max_concurrent_requests": CAP}
    yield from lone_gateway(tmp_path_factory, ops_models, ops_redis, "bodies", api)


def _stalled(gw: GatewayProcess, path: str, chunked: bool) -> socket.socket:
    """A connection that sent a whole head and the first bytes of its body, then nothing more."""
    sock = socket.create_connection(("127.0.0.1", gw.port), timeout=ANSWER_S)
    framing = "Transfer-Encoding: chunked\r\n" if chunked else "Content-Length: 200\r\n"
    start = b"9\r\n{\"model\":\r\n" if chunked else b"{\"model\":"
    sock.sendall(HEAD.format(path=path, key=API_KEY, framing=framing).encode() + start)
    return sock


def _timeouts(gw: GatewayProcess) -> float:
    """The 408s the gateway counted, on every route."""
    metrics = scrape(gw.url + "/metrics")
    return sum(v for (name, labels), v in metrics.items()
               if name == "fleet_gateway_requests_total" and ("status", "408") in labels)  # fmt: skip


def _log_lines(gw: GatewayProcess) -> list[str]:
    return [line for line in gw.log_path.read_text().splitlines() if "api.body_timeout_s" in line]


def test_stalled_bodies_are_answered_408_and_give_their_slots_back(gateway: GatewayProcess) -> None:
    before, logged = _timeouts(gateway), len(_log_lines(gateway))
    stalled = {  # as many as the cap: before, they held every slot for as long as they stayed open
        ("/v1/chat/completions", False): _stalled(gateway, "/v1/chat/completions", chunked=False),
        ("/v1/completions", True): _stalled(gateway, "/v1/completions", chunked=True),
        ("/v1/requests", False): _stalled(gateway, "/v1/requests", chunked=False),
        ("/v1/requests", True): _stalled(gateway, "/v1/requests", chunked=True),
    }
    assert len(stalled) == CAP
    try:
        for (path, chunked), sock in stalled.items():
            status, body = closing_answer(sock)
            assert status == 408, (path, chunked, body)
            if path == "/v1/requests":  # the native shape
                assert (body["error"], body["field"], body["limit"]) == ("request_timeout", "body", BODY_TIMEOUT_S)
                message = body["message"]
            else:  # OpenAI's
                error = body["error"]
                assert (error["code"], error["param"], error["type"]) == (
                    "request_timeout", "body", "invalid_request_error"), error
                message = error["message"]
            assert f"api.body_timeout_s={BODY_TIMEOUT_S:g}" in message, message
        # the stalled sockets are still open on this side: their slots were given back when they were answered
        with httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as http:
            assert http.get("/v1/models").status_code == 200
            accepted = http.post("/v1/requests", json={"model": "demo-lm", "input_ids": [5]})
            assert accepted.status_code == 202, accepted.text
    finally:
        for sock in stalled.values():
            sock.close()
    assert _timeouts(gateway) - before == CAP  # counted with the gateway's traffic, each on its route
    wait_until(lambda: len(_log_lines(gateway)) - logged == CAP, 30, "a warning per stalled body")
    lines = _log_lines(gateway)[logged:]
    assert all(f"not complete within {BODY_TIMEOUT_S:g} s" in line for line in lines), lines


def test_a_body_that_trickles_is_cut_at_the_bound_too(gateway: GatewayProcess) -> None:
    """The bound is on the whole body, not between reads: a byte every 0.2 s never stalls a read for long, and
    would have held the connection for 200 x 0.2 s (or for ever, with a longer body)."""
    with _stalled(gateway, "/v1/requests", chunked=False) as sock:
        sock.settimeout(0.2)  # paces the trickle: one byte each time nothing came back in 0.2 s
        raw, sent = b"", 0
        while not raw and sent < 150:  # short of the 200 declared bytes: the body never ends on its own
            try:
                raw = sock.recv(65536)
            except TimeoutError:
                sock.sendall(b" ")
                sent += 1
        assert raw, f"no answer while {sent} bytes of body trickled in"
        sock.settimeout(ANSWER_S)
        raw += b"".join(iter(lambda: sock.recv(65536), b""))
    assert raw.startswith(b"HTTP/1.1 408"), raw
    assert json.loads(raw.partition(b"\r\n\r\n")[2])["field"] == "body"
