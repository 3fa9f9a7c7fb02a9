"""producer.presence against a real redis-server and the workers' real heartbeat (workers.health.Heartbeat)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import redis.asyncio

from producer.presence import AsyncWorkerPresence, WorkerPresence, has_live_worker, has_live_worker_async
from tests.integration.ops_fixtures import wait_until
from tools.redis_server import EmbeddedRedis
from workers.health import Heartbeat


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as srv:
        yield srv


def _calls(client: redis.Redis[bytes]) -> dict[str, int]:
    stats = client.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}


def test_a_stopped_worker_is_gone_at_once_and_a_dead_one_when_its_heartbeat_expires(server: EmbeddedRedis) -> None:
    client = server.client()
    client.flushall()
    a = Heartbeat(client, "a@test", lambda: {"hostname": "a@test", "model": "m"}, period_s=0.2)
    b = Heartbeat(client, "b@test", lambda: {"hostname": "b@test", "model": "m"}, period_s=0.2)
    a.beat()
    assert has_live_worker(client, "m") and not has_live_worker(client, "other")
    assert asyncio.run(_async_check(server.url, "m"))
    a.stop()  # stopped: removed at once
    assert not has_live_worker(client, "m")
    b.beat()  # dies without stopping: gone once its heartbeat (3 periods, at least 1 s) has expired
    assert has_live_worker(client, "m")
    wait_until(lambda: not has_live_worker(client, "m"), 10, "the dead worker's heartbeat to expire")


async def _async_check(url: str, model: str) -> bool:
    client: redis.asyncio.Redis[bytes] = redis.asyncio.Redis.from_url(url)
    try:
        return await has_live_worker_async(client, model)
    finally:
        await client.aclose()  # type: ignore[attr-defined]  # types-redis predates aclose


def test_the_answer_costs_one_command_whatever_the_keyspace(server: EmbeddedRedis) -> None:
    """A busy fleet holds a result key per request: the answer must not scan them (it was 121 SCANs per
    gateway request in a bench run with ~60 k keys)."""
    client = server.client()
    client.flushall()
    with client.pipeline(transaction=False) as pipe:
        for i in range(20_000):
            pipe.set(f"celery-task-meta-{i}", "{}")
        pipe.execute()
    Heartbeat(client, "a@test", lambda: {"hostname": "a@test", "model": "m"}, period_s=5).beat()
    before = _calls(client)
    presence = WorkerPresence(client, cache_s=0.0)
    assert presence.has_worker("m") and not presence.has_worker("x")
    calls = {k: v - before.get(k, 0) for k, v in _calls(client).items() if v != before.get(k, 0)}
    calls.pop("info", None)
    assert calls == {"zcount": 2}, calls


def test_answers_are_reused_for_cache_s(server: EmbeddedRedis) -> None:
    client = server.client()
    client.flushall()
    now = [100.0]
    presence = WorkerPresence(client, cache_s=1.0, clock=lambda: now[0])
    assert not presence.has_worker("m")
    Heartbeat(client, "a@test", lambda: {"hostname": "a@test", "model": "m"}, period_s=5).beat()
    assert not presence.has_worker("m")  # the answer read at 100.0 still holds
    now[0] = 101.0
    assert presence.has_worker("m")

    async def both() -> tuple[bool, bool]:
        aclient: redis.asyncio.Redis[bytes] = redis.asyncio.Redis.from_url(server.url)
        try:
            apresence = AsyncWorkerPresence(aclient, cache_s=1.0, clock=time.monotonic)
            return await apresence.has_worker("m"), await apresence.has_worker("x")
        finally:
            await aclient.aclose()  # type: ignore[attr-defined]  # types-redis predates aclose

    assert asyncio.run(both()) == (True, False)
