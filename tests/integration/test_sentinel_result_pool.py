"""The worker's result backend through Sentinel shares one sweeping pool across its task threads.

Celery gives each task thread a backend of its own, and Celery's Sentinel backend built a Sentinel manager and
a master pool for each (the plain backend already shared one: :mod:`broker.result_backend`). So after a Redis
restart a write through one thread's pool released only that pool's half-closed sockets: each other thread's
stayed in ``CLOSE_WAIT`` until that thread wrote again, and a process-wide sweep (the worker's heartbeat) could
not reach a pool Celery had made. Now the threads share one :class:`protocol.redis_pools.SweepingSentinelPool`.

Real redis-server (killed and started again on its port) watched by a real Redis Sentinel; the backend is the
worker's (:func:`broker.result_backend.install`), reached from real threads.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis

from broker import make_celery, result_backend
from protocol.celeryconf import celery_config
from protocol.redis_pools import SweepingSentinelPool
from protocol.settings import load_settings
from tests.integration.ops_fixtures import wait_until
from tests.integration.test_pool_close_wait import POOL, _blocked, _close_wait, _push, _released
from tools.redis_server import EmbeddedRedis, EmbeddedSentinel

pytestmark = pytest.mark.timeout(120)

MASTER = "fleet"


@pytest.fixture
def sentinel(tmp_path: Path) -> Iterator[tuple[EmbeddedRedis, EmbeddedSentinel]]:
    """A master and one sentinel (quorum 1) that never fails it over within a test (down after 60 s)."""
    data = tmp_path / "redis"
    data.mkdir()
    with EmbeddedRedis(data_dir=data) as master:
        watcher = EmbeddedSentinel(master, MASTER, quorum=1, down_after_ms=60_000)
        watcher.start()
        try:
            with watcher.client() as admin:
                wait_until(lambda: admin.execute_command("SENTINEL", "get-master-addr-by-name", MASTER), 20,
                           "the sentinel to know the master")  # fmt: skip
            yield master, watcher
        finally:
            watcher.stop()


def test_task_threads_share_one_sweeping_pool(sentinel: tuple[EmbeddedRedis, EmbeddedSentinel]) -> None:
    master, watcher = sentinel
    settings = load_settings("/dev/null", redis_url=watcher.url, redis={"sentinel_master": MASTER})
    app = make_celery(celery_config(settings), "sentinel-pool-test")
    result_backend.install(app)  # as the worker does
    client_here: Callable[[], redis.Redis[bytes]] = lambda: app.backend.client  # noqa: E731
    keys = [f"hold-{i}" for i in range(POOL)]
    with ThreadPoolExecutor(POOL) as threads:  # each BLPOP holds one connection until its key is pushed
        held = [threads.submit(lambda key: (client_here().blpop([key], 0), client_here().connection_pool), key)
                for key in keys]  # fmt: skip
        wait_until(lambda: _blocked(master, POOL), 30, f"{POOL} BLPOPs to block")
        _push(master, keys)
        pools = {id(pool): pool for _, pool in (h.result(30) for h in held)}
        app.backend.store_result("sentinel-pool-test-id", {"ok": True}, "SUCCESS")
        stored = threads.submit(lambda: app.backend.get_task_meta("sentinel-pool-test-id")).result(30)
    assert stored["status"] == "SUCCESS" and stored["result"] == {"ok": True}, stored
    assert len(pools) == 1, f"{len(pools)} pools for {POOL} task threads"
    assert all(isinstance(pool, SweepingSentinelPool) for pool in pools.values()), pools
    master.kill()
    master.start()
    me = os.getpid()
    wait_until(lambda: _close_wait(me, master.port) >= POOL, 30, "the threads' sockets to be closed by Redis")
    assert client_here().ping()  # one thread's write finds its connection closed: the shared pool is swept
    assert _released(me, master.port) == 0
    app.close()
