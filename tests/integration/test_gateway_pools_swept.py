"""A gateway idle across a Redis restart releases every socket Redis closed, without a request.

Its pools release the sockets a restart closed (half-closed, ``CLOSE_WAIT``, an fd each) when they find one
closed, which they did only through their own use (:mod:`protocol.redis_pools`): before, a gateway that grew its
pools with long-polls and then saw no request kept them all after the restart, as long as it stayed idle. Now
its lifespan sweeps its pools every few seconds (:mod:`gateway.pool_sweeper`).

Real redis-server (killed and started again on its port), a real ``fleet api`` process, no worker (the requests
wait queued, so the long-polls hold their connections for their whole wait).
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from gateway.pool_sweeper import SWEEP_INTERVAL_S
from tests.integration.ops_fixtures import API_KEY, GatewayProcess, ops_models, wait_until
from tests.integration.test_pool_close_wait import POOL, _close_wait, _restart, _sockets_to, gateway_alone, server
from tools.processes import poll_until
from tools.redis_server import EmbeddedRedis

__all__ = ["gateway_alone", "ops_models", "server"]

pytestmark = pytest.mark.timeout(240)

RELEASE_S = 6 * SWEEP_INTERVAL_S
"""Bound of the wait for the half-closed sockets to go with no request (s): a failure bound only."""


def test_an_idle_gateway_releases_the_sockets_a_redis_restart_closed(
    gateway_alone: GatewayProcess, server: EmbeddedRedis
) -> None:
    gateway, pid = gateway_alone, gateway_alone.proc.pid
    headers = {"X-API-Key": API_KEY}
    ids = []
    for i in range(40):
        reply = httpx.post(gateway.url + "/v1/requests", json={"model": "demo-encoder", "text": f"wait {i}"},
                           headers=headers, timeout=30)  # fmt: skip
        assert reply.status_code == 202, reply.text
        ids.append(str(reply.json()["request_id"]))

    def grown() -> bool:  # rounds of concurrent long-polls until the pools hold POOL connections
        if _sockets_to(pid, server.port) < POOL:
            with ThreadPoolExecutor(len(ids)) as pool:
                polls = [pool.submit(httpx.get, f"{gateway.url}/v1/requests/{rid}", params={"wait_s": 1},
                                     headers=headers, timeout=30) for rid in ids]  # fmt: skip
                assert {p.result().status_code for p in polls} == {200}
        return _sockets_to(pid, server.port) >= POOL

    wait_until(grown, 120, f"the gateway to hold {POOL} connections to Redis", poll_s=0)
    _restart(server)  # and no request after it: only the sweep can release what Redis closed
    wait_until(lambda: _close_wait(pid, server.port) >= POOL // 2, 30, "the gateway's sockets to be closed by Redis")
    before = _close_wait(pid, server.port)
    with contextlib.suppress(TimeoutError):
        poll_until(lambda: _close_wait(pid, server.port) == 0, RELEASE_S, "the half-closed sockets to go", poll_s=0.2)
    left = _close_wait(pid, server.port)
    assert left == 0, f"{left} of {before} sockets to Redis stay half-closed in a gateway idle {RELEASE_S:g} s since"
