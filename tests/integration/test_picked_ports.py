"""A server started on a port picked free a moment ago starts on another pick when a process binds that port
first (another test's server, a client's outgoing connection): the demo's Flower, and the tests' gateway (a
test does not error at setup). ``EmbeddedRedis``'s own case is in ``test_fleet_redis.py``."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from producer import demo_flower
from producer.demo_flower import DemoFlower
from tests.integration import ops_fixtures
from tests.integration.conftest import picks_first
from tests.integration.ops_fixtures import OpsFleet, ops_fleet, ops_models, ops_redis
from tools.redis_server import EmbeddedRedis

__all__ = ["ops_fleet", "ops_models", "ops_redis"]


def test_a_gateway_whose_picked_port_is_taken_starts_on_another(
    ops_fleet: OpsFleet, taken_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ops_fixtures, "free_port", picks_first(taken_port))
    gateway = ops_fleet.gateway(ops_fleet.config(serve=("demo-lm",)))
    assert gateway.port != taken_port
    assert httpx.get(gateway.url + "/healthz", timeout=10).status_code == 200
    assert f"{taken_port}: the port is already in use" in gateway.log_path.read_text()  # the first pick was tried


def test_the_demo_s_flower_whose_picked_port_is_taken_starts_on_another(
    redis_server: EmbeddedRedis, taken_port: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(demo_flower, "free_port", picks_first(taken_port))
    said: list[str] = []
    flower = DemoFlower(redis_server.url, tmp_path).start()
    try:
        assert flower.wait_up(said.append, timeout_s=120), said
        assert flower.port != taken_port
        assert httpx.get(flower.url + "/api/workers", auth=flower.auth, timeout=10).status_code == 200
        assert "address already in use" in flower.log_path.read_text().lower()  # the first pick was tried
    finally:
        flower.stop()


def test_the_demo_s_flower_that_exits_for_another_reason_is_said_with_its_log(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    said: list[str] = []
    flower = DemoFlower(redis_server.url, tmp_path).start()
    assert flower.proc is not None
    flower.proc.kill()
    flower.proc.wait(10)
    assert not flower.wait_up(said.append, timeout_s=3600)  # returns when it sees the exit, not at the timeout
    assert said == [f"Flower exited with -9 (its log: {flower.log_path}); the demo goes on without it"]
