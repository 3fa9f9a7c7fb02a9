"""A client that stops reading its response does not hold the gateway's writer for ever: once the
connection's writes have waited ``api.write_stall_s`` for it, the gateway aborts the connection and says so.
A real ``fleet api`` process and a raw socket that reads nothing (no HTTP client stops reading on purpose).

Before: uvicorn's writer waited on the client with no bound, so a stream reader that stalled kept its
connection, its relay and its generation for as long as it kept the socket open.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.integration.ops_fixtures import GatewayProcess, lone_gateway, ops_models, ops_redis, wait_until
from tools.redis_server import EmbeddedRedis

__all__ = ["ops_models", "ops_redis"]

STALL_S = 2.0
"""The gateway's ``api.write_stall_s`` here (s)."""
UNREAD_MB = 16
"""Bytes of responses asked for and left unread (MB): more than loopback's socket buffers hold (4 MiB to
send, the reader's shrunk to a few KiB) and the transport's 64 KiB."""


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, ops_models: Any, ops_redis: EmbeddedRedis
) -> Iterator[GatewayProcess]:
    yield from lone_gateway(tmp_path_factory, ops_models, ops_redis, "stalled", {"write_stall_s": STALL_S})


def _stalled_log_lines(gw: GatewayProcess) -> list[str]:
    return [line for line in gw.log_path.read_text().splitlines() if "api.write_stall_s" in line]


def test_a_client_that_stops_reading_is_aborted_and_the_gateway_serves_on(gateway: GatewayProcess) -> None:
    schema_bytes = len(httpx.get(gateway.url + "/openapi.json", timeout=30).content)
    asks = (UNREAD_MB << 20) // schema_bytes + 1
    before = len(_stalled_log_lines(gateway))
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: the window stays small
        sock.settimeout(120)
        sock.connect(("127.0.0.1", gateway.port))
        # pipelined: the gateway answers them one after another into a socket nobody reads
        sock.sendall(b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n" * asks)
        lines = wait_until(lambda: _stalled_log_lines(gateway)[before:], 120, "the gateway to abort the stalled reader")
        assert f"waited {STALL_S:g} s for the client to read" in lines[0], lines
        # what had been sent still arrives, then the connection ends short of what was asked for
        got = 0
        try:
            while chunk := sock.recv(1 << 20):
                got += len(chunk)
        except ConnectionResetError:
            pass
    assert 0 < got < asks * schema_bytes, (got, asks * schema_bytes)
    assert httpx.get(gateway.url + "/healthz", timeout=30).status_code == 200
