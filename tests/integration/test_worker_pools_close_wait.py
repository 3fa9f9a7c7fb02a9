"""A worker holds no socket Redis closed once it beat a few times after a Redis restart.

A Redis restart closes every connection from the server's side; an idle pooled connection then sits
half-closed (``CLOSE_WAIT``, an fd held) until it is taken again. :mod:`protocol.redis_pools` sweeps a pool
when a taken connection turns out closed, but only the pool it is used through: a pool the worker rarely
uses after the restart kept its half-closed sockets. Before the fix a worker that had served requests kept
such sockets after the restart and several heartbeats; now its heartbeat sweeps every Redis pool of the
process (:func:`protocol.redis_pools.sweep_process_pools`).

Real redis-server (killed and started again on its port), a real ``celery worker`` serving real ONNX models.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from producer.client import FleetClient
from protocol.keys import WORKER_KEY_PREFIX
from protocol.settings import load_settings
from tests.integration.ops_fixtures import ModelPaths, OpsFleet, ops_models, wait_until
from tools.processes import poll_until
from tools.redis_server import EmbeddedRedis

__all__ = ["ops_models"]

pytestmark = pytest.mark.timeout(240)

REQUESTS = 24
"""Requests served before the restart, several at once, so the worker's pools hold several connections."""
BEATS_AFTER_RESTART = 4
"""Heartbeats the worker publishes after the restart before its sockets are counted."""
RELEASE_S = 30.0
"""Bound of the wait for the half-closed sockets to go (s): a failure bound only."""


def _close_wait(pid: int, port: int) -> int:
    """Sockets of ``pid`` to ``port`` in ``CLOSE_WAIT`` (``/proc/<pid>/net/tcp`` and its fds)."""
    return sum(1 for c in psutil.Process(pid).net_connections("tcp")
               if c.raddr and c.raddr.port == port and c.status == psutil.CONN_CLOSE_WAIT)  # fmt: skip


@pytest.fixture
def fleet(tmp_path: Path, ops_models: ModelPaths) -> Iterator[OpsFleet]:
    data = tmp_path / "redis"
    data.mkdir()
    with EmbeddedRedis(data_dir=data) as server:
        ops = OpsFleet(tmp_path, ops_models, server)
        try:
            yield ops
        finally:
            ops.close()


def _next_beat(fleet: OpsFleet, hostname: str, after: float | None) -> float:
    """The ``heartbeat_unix_s`` of ``hostname``'s next beat after the one published at ``after``."""

    def fresh() -> float | None:
        raw = fleet.redis.get(WORKER_KEY_PREFIX + hostname)
        at = json.loads(raw).get("heartbeat_unix_s") if raw else None
        return at if at is not None and at != after else None

    beat: float = wait_until(fresh, 60, f"a heartbeat of {hostname}")
    return beat


def test_a_worker_releases_every_socket_a_redis_restart_closed(fleet: OpsFleet) -> None:
    config = fleet.config(serve=("demo-encoder",))
    worker = fleet.worker(config, "demo-encoder")
    assert worker.proc is not None
    pid, port = worker.proc.pid, fleet.server.port
    client = FleetClient(load_settings(config))
    try:
        ids = client.submit_many("demo-encoder", [f"grow the pools {i}" for i in range(REQUESTS)], progress=False)
        done = client.wait(ids, timeout_s=60)
        assert all(not isinstance(d, Exception) for d in done), done
    finally:
        client.close()
    fleet.server.kill()
    fleet.server.start()
    wait_until(lambda: _close_wait(pid, port) > 0, 30, "the worker's sockets to be closed by Redis")
    before = _close_wait(pid, port)
    beat = None
    for _ in range(BEATS_AFTER_RESTART):
        beat = _next_beat(fleet, worker.hostname, beat)
    with contextlib.suppress(TimeoutError):
        poll_until(lambda: _close_wait(pid, port) == 0, RELEASE_S, "the half-closed sockets to go", poll_s=0.1)
    left = _close_wait(pid, port)
    assert left == 0, (f"{left} of {before} sockets to Redis stay half-closed after the restart and "
                       f"{BEATS_AFTER_RESTART} beats")
