"""A gateway whose Redis fails while it queues a request answers `503` naming the ID it made for it, so the
caller can tell whether it runs and send it again under that ID, where it runs once.

Before, the caller got `{"error": "unavailable", "type": "ConnectionError"}` and no ID: the request may have
been queued (Redis ran the step, its reply was lost), and a retry without an ID is a second request. Real
gateway process and worker; the gateway reaches a real redis-server through
:class:`~tests.integration.redis_cut_proxy.CutProxy`, which cuts the link at the claim-and-queue script
(``lose_reply``: Redis runs it, the gateway never hears so; ``drop``: Redis never runs it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from broker import waiting_requests
from tests.integration.fleet_fixtures import Fleet
from tests.integration.ops_fixtures import GatewayProcess
from tests.integration.redis_cut_proxy import CLAIM_AND_QUEUE_SHA, CutProxy
from tools.processes import poll_until
from tools.redis_server import EmbeddedRedis

BODY = {"model": "demo-lm", "input_ids": [5, 6, 7]}


def _gateway(fleet: Fleet, proxy: CutProxy, tmp_path: Path, **api: Any) -> GatewayProcess:
    cfg = fleet.config(redis_url=proxy.url, api=api)
    return GatewayProcess(cfg, tmp_path / "gateway.log").wait_ready()


def _queued(r: redis.Redis[bytes]) -> int:
    """Requests waiting on the demo LM's queue (its priority lists included)."""
    return waiting_requests(r, "fleet.demo-lm")


def _warm_up(gateway: GatewayProcess) -> None:
    assert httpx.post(f"{gateway.url}/v1/requests", json=BODY, timeout=60).status_code == 202


@pytest.mark.parametrize("group_submits", [True, False], ids=["grouped", "one-by-one"])
@pytest.mark.parametrize("mode", ["lose_reply", "drop"])
def test_a_cut_while_the_gateway_queues_names_the_id_and_a_resend_under_it_runs_once(
    fleet: Fleet, proxy: CutProxy, redis_server: EmbeddedRedis, tmp_path: Path, group_submits: bool, mode: str
) -> None:
    gateway = _gateway(fleet, proxy, tmp_path, group_submits=group_submits)
    r = redis.Redis.from_url(redis_server.url)
    _warm_up(gateway)  # the script is loaded (a first EVALSHA would be answered NOSCRIPT, and run again)
    r.flushdb()  # the warm-up's request and marker gone; the script stays
    proxy.arm("EVALSHA", first_arg=CLAIM_AND_QUEUE_SHA, nth=1, mode=mode)  # type: ignore[arg-type]
    cut = httpx.post(f"{gateway.url}/v1/requests", json=BODY, timeout=60)
    payload = cut.json()
    print(f"\ncut ({mode}, group_submits={group_submits}): {cut.status_code} {payload}")
    assert cut.status_code == 503 and payload["type"] == "SubmitInterrupted", payload
    (rid,) = payload["unknown_ids"]
    assert payload["request_ids"] == [rid] and payload["queued_ids"] == payload["unqueued_ids"] == []
    assert f"request {rid} may or may not be queued" in payload["message"] and "request_id" in payload["message"]
    assert "127.0.0.1" not in payload["message"]  # the Redis address stays in the gateway's log
    assert _queued(r) == (1 if mode == "lose_reply" else 0)  # Redis ran the step, or never saw it

    proxy.restore()
    poll_until(lambda: httpx.get(f"{gateway.url}/readyz", timeout=5).status_code != 503
               or "Redis" not in httpx.get(f"{gateway.url}/readyz", timeout=5).text, 30, "the gateway to reach Redis")
    again = httpx.post(f"{gateway.url}/v1/requests", json={**BODY, "request_id": rid}, timeout=60)
    assert again.status_code in (200, 202), again.text
    assert _queued(r) == 1  # queued once, whichever way the cut fell
    fleet.worker(fleet.config())
    done = httpx.get(f"{gateway.url}/v1/requests/{rid}", params={"wait_s": 60}, timeout=90).json()
    assert done["status"] == "succeeded", done
    assert _queued(r) == 0
    gateway.stop()


def test_an_openai_call_cut_while_queueing_says_which_request_to_poll(
    fleet: Fleet, proxy: CutProxy, tmp_path: Path
) -> None:
    gateway = _gateway(fleet, proxy, tmp_path)
    _warm_up(gateway)
    proxy.arm("EVALSHA", first_arg=CLAIM_AND_QUEUE_SHA, nth=1, mode="lose_reply")
    cut = httpx.post(f"{gateway.url}/v1/completions", json={"model": "demo-lm", "prompt": [5, 6, 7], "max_tokens": 2},
                     timeout=60)  # fmt: skip
    error = cut.json()["error"]
    print(f"\nOpenAI completion cut while queueing: {cut.status_code} {error}")
    assert cut.status_code == 503 and error["code"] == "unavailable"
    assert "may or may not be queued" in error["message"] and "GET /v1/requests/" in error["message"]
    gateway.stop()
