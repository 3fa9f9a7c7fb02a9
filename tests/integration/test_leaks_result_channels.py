"""A gateway's result channels do not outlive their waits across a Redis restart.

Long-polls (``GET /v1/requests/{id}?wait_s=``) subscribe their result channels on the gateway's one
pub/sub connection (:mod:`gateway.result_notifier`). Here they wait on requests no worker serves, Redis is
stopped (SIGTERM, AOF) under them, and each answers (503) while Redis is down, so its ``UNSUBSCRIBE`` is
lost with the connection; redis-py subscribes every channel it has not seen unsubscribed when it
reconnects. The gateway must leave those channels again: after the restart Redis's channels settle back
to the baseline, whatever the number of waits (4, then 12), instead of one subscription per wait for good.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis

from tests.integration.ops_fixtures import API_KEY, GatewayProcess, ModelPaths, OpsFleet, ops_models, wait_until
from tools.processes import poll_until
from tools.redis_server import EmbeddedRedis

__all__ = ["ops_models"]

SETTLE_S = 20.0
"""Bound of the wait for Redis's channels to settle after the restart (s)."""


@pytest.fixture
def gateway_alone(tmp_path: Path, ops_models: ModelPaths) -> Iterator[tuple[GatewayProcess, EmbeddedRedis]]:
    data = tmp_path / "redis"
    data.mkdir()
    server = EmbeddedRedis(appendonly=True, data_dir=data).start()
    fleet = OpsFleet(tmp_path, ops_models, server)
    try:
        yield fleet.gateway(fleet.config(serve=("demo-encoder",))), server  # no worker: requests wait queued
    finally:
        fleet.close()
        server.stop()
        shutil.rmtree(data, ignore_errors=True)


def _waits_across_restart(gateway: GatewayProcess, server: EmbeddedRedis, r: redis.Redis[bytes], n: int) -> None:
    """``n`` long-polls subscribed, Redis stopped under them, every one answered, Redis started again."""
    headers = {"X-API-Key": API_KEY}
    ids = [httpx.post(gateway.url + "/v1/requests", json={"model": "demo-encoder", "text": f"wait {i}"},
                      headers=headers).json()["request_id"] for i in range(n)]
    channels = [f"celery-task-meta-{rid}" for rid in ids]
    with ThreadPoolExecutor(n) as pool:
        polls = [pool.submit(httpx.get, f"{gateway.url}/v1/requests/{rid}", params={"wait_s": 30}, headers=headers,
                             timeout=60) for rid in ids]
        wait_until(lambda: all(subs for _, subs in r.pubsub_numsub(*channels)), 20, "every long-poll to subscribe")
        server.stop()  # its data folder is its own: kept
        assert {p.result().status_code for p in polls} == {503}
    server.start()


def _channels(r: redis.Redis[bytes]) -> set[bytes]:
    return set(r.pubsub_channels())


def _settled(r: redis.Redis[bytes], base: set[bytes]) -> bool:
    """The gateway's pub/sub connection is back (its last command a (UN)SUBSCRIBE: the channels its reconnection
    subscribed again) and no channel beyond ``base`` is subscribed."""
    back = any(c.get("cmd") in ("subscribe", "unsubscribe") for c in r.client_list())
    return back and _channels(r) <= base


def test_result_channels_settle_back_after_a_redis_restart(
    gateway_alone: tuple[GatewayProcess, EmbeddedRedis],
) -> None:
    gateway, server = gateway_alone
    r = redis.Redis(port=server.port)
    base = _channels(r)
    for n in (4, 12):
        _waits_across_restart(gateway, server, r, n)
        with contextlib.suppress(TimeoutError):  # the assertion says what stayed
            poll_until(lambda: _settled(r, base), SETTLE_S, "the channels to settle", poll_s=0.2)
        left = _channels(r) - base
        assert not left, f"after {n} waits across a restart, {len(left)} channels stay subscribed: {sorted(left)[:3]}"
