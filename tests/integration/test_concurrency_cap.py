"""A gateway process answers at most ``api.max_concurrent_requests`` requests at once: one more is answered
``503`` at once, naming the setting and the limit, with ``Retry-After``, while the probes and ``/metrics``
still answer; once the requests in progress end, new ones are served again. A real ``fleet api`` process,
a real worker, long-polls held open by a request no worker serves yet.

The third request is sent only once ``/metrics`` (never refused, never counted) shows both long-polls held
(``fleet_gateway_requests_in_progress 2.0``), and nothing else is sent while they arrive. The test this
replaces polled for the 503 with GETs of its own while the long-polls were still arriving: a long-poll that
came while such a GET was being answered was itself refused ("the gateway is answering 2 requests"), one
long-poll stayed, and no 503 could come for the 60 s of its wait (on a shared 2-core host: 2 runs of 3).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest

from tests.integration.ops_fixtures import (
    API_KEY,
    GatewayProcess,
    OpsFleet,
    ops_fleet,
    ops_models,
    ops_redis,
    scrape,
    wait_until,
)

__all__ = ["ops_fleet", "ops_models", "ops_redis"]

CAP = 2
"""The gateway's ``api.max_concurrent_requests`` here."""
HOLD_S = 600
"""The long-polls' ``wait_s`` (and ``api.max_wait_s``, s): they end when the worker serves the request, never
by their bound while the test runs."""
IN_PROGRESS = ("fleet_gateway_requests_in_progress", ())


def _held(gateway: GatewayProcess, polls: list[Future[httpx.Response]], n: int) -> bool:
    """Whether the gateway counts ``n`` requests in progress; fails at once if a long-poll has been answered."""
    for p in polls:
        if p.done():
            answer = p.result()
            pytest.fail(f"a long-poll was answered before it was held: {answer.status_code} {answer.text}")
    return scrape(gateway.url + "/metrics")[IN_PROGRESS] == n


def test_one_request_past_the_cap_is_refused_at_once_and_the_probes_still_answer(ops_fleet: OpsFleet) -> None:
    fleet = ops_fleet
    config = fleet.config(api={"max_concurrent_requests": CAP, "max_wait_s": HOLD_S})
    gateway = fleet.gateway(config)
    http = httpx.Client(base_url=gateway.url, headers={"X-API-Key": API_KEY}, timeout=HOLD_S + 60)
    accepted = http.post("/v1/requests", json={"model": "demo-encoder", "input_ids": [1, 2, 3]})
    assert accepted.status_code == 202, accepted.text
    rid = accepted.json()["request_id"]
    # nothing counted once the submit has ended (its slot is given back after its response has been sent)
    wait_until(lambda: scrape(gateway.url + "/metrics")[IN_PROGRESS] == 0, 30, "the submit to end")

    pool = ThreadPoolExecutor(CAP)
    polls = [pool.submit(http.get, f"/v1/requests/{rid}", params={"wait_s": HOLD_S}) for _ in range(CAP)]
    try:  # CAP long-polls on a request no worker serves yet
        wait_until(lambda: _held(gateway, polls, CAP), 60, f"{CAP} long-polls held")
        refused = http.get(f"/v1/requests/{rid}")
        assert refused.status_code == 503, refused.text
        payload = refused.json()
        assert (payload["error"], payload["field"], payload["limit"]) == (
            "overloaded", "api.max_concurrent_requests", CAP), payload
        assert f"answering {CAP} requests" in payload["message"], payload
        assert refused.headers["retry-after"] == "1"
        openai = http.get("/v1/models")  # the OpenAI routes refuse in OpenAI's shape
        assert openai.status_code == 503 and openai.json()["error"]["param"] == "api.max_concurrent_requests"
        for probe in ("/healthz", "/health", "/readyz", "/metrics"):  # never refused: an overloaded replica is not dead
            answer = http.get(probe)  # (/readyz answers its own 503 here: no worker serves the models yet)
            assert answer.status_code == 200 or "overloaded" not in answer.text, (probe, answer.text)
        assert http.get("/healthz").status_code == 200
        assert _held(gateway, polls, CAP)  # the long-polls it holds are untouched, and still the only ones counted
        fleet.worker(config, "demo-encoder")
        answers = [p.result() for p in polls]
    finally:
        if not all(p.done() for p in polls):  # a failure above: the long-polls end with the gateway, not at HOLD_S
            gateway.stop()
        pool.shutdown()
    assert [a.status_code for a in answers] == [200] * CAP, [a.text for a in answers]
    assert all(a.json()["status"] == "succeeded" for a in answers)
    wait_until(lambda: scrape(gateway.url + "/metrics")[IN_PROGRESS] == 0, 30, "every counted request to end")
    assert http.get(f"/v1/requests/{rid}").status_code == 200  # served again once they ended
    metrics = scrape(gateway.url + "/metrics")
    refusals = {labels: v for (name, labels), v in metrics.items()
                if name == "fleet_gateway_requests_total" and ("status", "503") in labels}  # fmt: skip
    assert sum(refusals.values()) >= 2, refusals  # the refusals are counted with the gateway's traffic (+ /readyz)
    assert metrics[("fleet_gateway_overloaded_total", ())] == 2  # the two refusals above, and nothing else
    http.close()
