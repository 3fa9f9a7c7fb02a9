"""Idle pooled connections Redis closed are released as soon as one is found closed, not when each is reused.

A Redis restart closes every connection from the server's side; a pooled connection nobody uses then
sits half-closed (``CLOSE_WAIT``, an fd held) until it is taken again (:mod:`protocol.redis_pools`).
Each test grows a pool of the fleet's (:func:`protocol.redis_conn.sync_client`, :func:`async_client`,
the worker's result backend, and the gateway's pools in a real ``fleet api`` process), restarts
``redis-server`` on its port, sends one command or request, and waits for the process's sockets to
Redis in ``CLOSE_WAIT`` to be gone (the deadline only bounds a failure). Before the fix they stayed:
75 of a gateway's 77 after 200 long-polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
import redis

from broker import make_celery, result_backend
from protocol.celeryconf import celery_config
from protocol.redis_conn import async_client, sync_client
from protocol.settings import load_settings
from tests.integration.ops_fixtures import API_KEY, GatewayProcess, ModelPaths, OpsFleet, ops_models, wait_until
from tools.processes import poll_until
from tools.redis_server import EmbeddedRedis

__all__ = ["ops_models"]

POOL = 12
"""Connections each test makes its pool hold at once before the restart."""
RELEASE_S = 30.0
"""Bound of the wait for the half-closed sockets to go after the first command (s): a failure bound only."""


def _close_wait(pid: int, port: int) -> int:
    """Sockets of ``pid`` to ``port`` in ``CLOSE_WAIT`` (from ``/proc/<pid>/net/tcp`` and its fds)."""
    return sum(1 for c in psutil.Process(pid).net_connections("tcp")
               if c.raddr and c.raddr.port == port and c.status == psutil.CONN_CLOSE_WAIT)  # fmt: skip


def _released(pid: int, port: int) -> int:
    """How many stay half-closed once the wait for them to go ended (0 when they went)."""
    with contextlib.suppress(TimeoutError):
        poll_until(lambda: _close_wait(pid, port) == 0, RELEASE_S, "the half-closed sockets to go", poll_s=0.1)
    return _close_wait(pid, port)


def _blocked(server: EmbeddedRedis, n: int) -> bool:
    with server.client() as admin:  # closed at once: only the pools under test keep sockets to Redis
        return sum(1 for c in admin.client_list() if c.get("cmd") == "blpop") >= n


def _push(server: EmbeddedRedis, keys: list[str]) -> None:
    with server.client() as admin:
        for key in keys:
            admin.rpush(key, b"x")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    data = tmp_path / "redis"
    data.mkdir()
    with EmbeddedRedis(data_dir=data) as srv:
        yield srv


def _restart(server: EmbeddedRedis) -> None:
    server.kill()
    server.start()


@pytest.mark.parametrize("per_thread", [False, True], ids=["sync_client", "worker_result_backend"])
def test_sync_pool_releases_the_connections_a_redis_restart_closed(server: EmbeddedRedis, per_thread: bool) -> None:
    """``per_thread``: each thread uses its own client, as the worker's task threads use the result backend
    (Celery gives each thread a backend of its own); otherwise one :func:`sync_client` is shared."""
    settings = load_settings("/dev/null", redis_url=server.url)
    if per_thread:
        app = make_celery(celery_config(settings), "close-wait-test")
        result_backend.install(app)  # as the worker does
        client_here: Callable[[], redis.Redis[bytes]] = lambda: app.backend.client  # noqa: E731
    else:
        shared = sync_client(settings)
        client_here = lambda: shared  # noqa: E731
    keys = [f"hold-{i}" for i in range(POOL)]
    with ThreadPoolExecutor(POOL) as pool:  # each BLPOP holds one connection until its key is pushed
        held = [pool.submit(lambda key: client_here().blpop([key], 0), key) for key in keys]
        wait_until(lambda: _blocked(server, POOL), 30, f"{POOL} BLPOPs to block")
        _push(server, keys)
        assert all(h.result(30) for h in held)
    _restart(server)
    me = os.getpid()
    wait_until(lambda: _close_wait(me, server.port) >= POOL, 30, "the clients' sockets to be closed by Redis")
    assert client_here().ping()
    assert _released(me, server.port) == 0


def test_async_pool_releases_the_connections_a_redis_restart_closed(server: EmbeddedRedis) -> None:
    me = os.getpid()

    async def scenario() -> int:
        r = async_client(load_settings("/dev/null", redis_url=server.url))
        keys = [f"hold-{i}" for i in range(POOL)]
        held = [asyncio.ensure_future(r.blpop([key], 0)) for key in keys]
        await asyncio.to_thread(wait_until, lambda: _blocked(server, POOL), 30, f"{POOL} BLPOPs to block")
        await r.rpush("unused", b"x")  # one more connection: the pool now holds POOL + 1
        await asyncio.to_thread(_push, server, keys)
        assert all(await asyncio.gather(*held))
        # the event loop runs while Redis restarts, as in the gateway: the server's closes are received
        await asyncio.to_thread(_restart, server)
        await asyncio.to_thread(wait_until, lambda: _close_wait(me, server.port) >= POOL, 30,
                                "the pool's sockets to be closed by Redis")  # fmt: skip
        assert await r.ping()
        left = await asyncio.to_thread(_released, me, server.port)
        await r.aclose()  # type: ignore[attr-defined]
        return left

    assert asyncio.run(scenario()) == 0


@pytest.fixture
def gateway_alone(tmp_path: Path, ops_models: ModelPaths, server: EmbeddedRedis) -> Iterator[GatewayProcess]:
    fleet = OpsFleet(tmp_path, ops_models, server)
    try:
        yield fleet.gateway(fleet.config(serve=("demo-encoder",)))  # no worker: requests wait queued
    finally:
        fleet.close()


def _sockets_to(pid: int, port: int) -> int:
    return sum(1 for c in psutil.Process(pid).net_connections("tcp") if c.raddr and c.raddr.port == port)


def test_gateway_releases_its_pools_connections_after_a_redis_restart(
    gateway_alone: GatewayProcess, server: EmbeddedRedis
) -> None:
    """Concurrent long-polls grow the gateway's pools; after the restart and one request, none stays half-closed."""
    gateway, pid = gateway_alone, gateway_alone.proc.pid
    headers = {"X-API-Key": API_KEY}

    def submit(text: str) -> str:
        reply = httpx.post(gateway.url + "/v1/requests", json={"model": "demo-encoder", "text": text},
                           headers=headers, timeout=30)  # fmt: skip
        assert reply.status_code == 202, reply.text
        return str(reply.json()["request_id"])

    ids = [submit(f"wait {i}") for i in range(40)]

    def long_polls() -> None:
        with ThreadPoolExecutor(len(ids)) as pool:
            polls = [pool.submit(httpx.get, f"{gateway.url}/v1/requests/{rid}", params={"wait_s": 1},
                                 headers=headers, timeout=30) for rid in ids]  # fmt: skip
            assert {p.result().status_code for p in polls} == {200}

    def grown() -> bool:  # rounds of concurrent long-polls until the pools hold POOL connections
        if _sockets_to(pid, server.port) < POOL:
            long_polls()
        return _sockets_to(pid, server.port) >= POOL

    wait_until(grown, 120, f"the gateway to hold {POOL} connections to Redis", poll_s=0)
    _restart(server)  # nothing uses the idle pools meanwhile: what Redis closed stays half-closed until a request
    wait_until(lambda: _close_wait(pid, server.port) >= POOL // 2, 30, "the gateway's sockets to be closed by Redis")
    before = _close_wait(pid, server.port)
    rid = submit("after the restart")  # the sync client and Celery's producer
    assert httpx.get(f"{gateway.url}/v1/requests/{rid}", headers=headers, timeout=30).status_code == 200  # asyncio
    left = _released(pid, server.port)
    assert left == 0, f"{left} of {before} sockets to Redis stay half-closed after the restart and one request"
