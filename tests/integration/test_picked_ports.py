"""A server the tests start on a port picked free a moment ago starts on another pick when a process binds that
port first (another test's server, a client's outgoing connection): the test does not error at setup.
``EmbeddedRedis``'s own case is in ``test_fleet_redis.py``."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import pytest

from tests.integration import ops_fixtures
from tests.integration.ops_fixtures import OpsFleet, ops_fleet, ops_models, ops_redis
from tools.redis_server import free_port

__all__ = ["ops_fleet", "ops_models", "ops_redis"]


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another process (here: this test) holds bound; the gateway's bind of it fails."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])


def test_a_gateway_whose_picked_port_is_taken_starts_on_another(
    ops_fleet: OpsFleet, taken_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    picks = iter([taken_port])
    monkeypatch.setattr(ops_fixtures, "free_port", lambda: next(picks, None) or free_port())
    gateway = ops_fleet.gateway(ops_fleet.config(serve=("demo-lm",)))
    assert gateway.port != taken_port
    assert httpx.get(gateway.url + "/healthz", timeout=10).status_code == 200
    assert f"{taken_port}: the port is already in use" in gateway.log_path.read_text()  # the first pick was tried
