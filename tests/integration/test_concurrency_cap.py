"""A gateway process answers at most ``api.max_concurrent_requests`` requests at once: one more is answered
``503`` at once, naming the setting and the limit, with ``Retry-After``, while the probes and ``/metrics``
still answer; once the requests in progress end, new ones are served again. A real ``fleet api`` process,
a real worker, long-polls held open by a request no worker serves yet.

Before: nothing bounded the requests in progress; past the open-file limit the process could accept nothing
and open no Redis connection, probes included.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.integration.ops_fixtures import (
    API_KEY,
    GatewayProcess,
    OpsFleet,
    ops_fleet,
    ops_models,
    ops_redis,
    wait_until,
)

__all__ = ["ops_fleet", "ops_models", "ops_redis"]

CAP = 2
"""The gateway's ``api.max_concurrent_requests`` here."""


def test_one_request_past_the_cap_is_refused_at_once_and_the_probes_still_answer(ops_fleet: OpsFleet) -> None:
    fleet = ops_fleet
    config = fleet.config(api={"max_concurrent_requests": CAP})
    gateway: GatewayProcess = fleet.gateway(config)
    headers = {"X-API-Key": API_KEY}
    http = httpx.Client(base_url=gateway.url, headers=headers, timeout=120)
    body = {"model": "demo-encoder", "input_ids": [1, 2, 3]}
    accepted = http.post("/v1/requests", json=body)
    assert accepted.status_code == 202, accepted.text
    rid = accepted.json()["request_id"]

    with ThreadPoolExecutor(CAP) as pool:  # CAP long-polls on a request no worker serves yet
        polls = [pool.submit(http.get, f"/v1/requests/{rid}", params={"wait_s": 60}) for _ in range(CAP)]
        refused = wait_until(lambda: (r := http.get(f"/v1/requests/{rid}")).status_code == 503 and r, 60,
                             "a request past the cap to be refused")  # fmt: skip
        payload = refused.json()
        assert (payload["error"], payload["field"], payload["limit"]) == (
            "overloaded", "api.max_concurrent_requests", CAP), payload
        assert refused.headers["retry-after"] == "1"
        openai = http.get("/v1/models")  # the OpenAI routes refuse in OpenAI's shape
        assert openai.status_code == 503 and openai.json()["error"]["param"] == "api.max_concurrent_requests"
        for probe in ("/healthz", "/health", "/readyz", "/metrics"):  # never refused: an overloaded replica is not dead
            answer = http.get(probe)  # (/readyz answers its own 503 here: no worker serves the models yet)
            assert answer.status_code == 200 or "overloaded" not in answer.text, (probe, answer.text)
        assert http.get("/healthz").status_code == 200
        assert not any(p.done() for p in polls)  # the long-polls it holds are untouched
        assert f"fleet_gateway_requests_in_progress {CAP}.0" in http.get("/metrics").text.splitlines()
        fleet.worker(config, "demo-encoder")
        answers = [p.result() for p in polls]
    assert [a.status_code for a in answers] == [200] * CAP and all(a.json()["status"] == "succeeded" for a in answers)
    assert http.get(f"/v1/requests/{rid}").status_code == 200  # served again once they ended
    metrics = http.get("/metrics").text.splitlines()
    assert any('status="503"' in line for line in metrics)  # the refusals are counted with the gateway's traffic
    assert "fleet_gateway_requests_in_progress 0.0" in metrics  # every request it counted has ended
    overloaded = next(line for line in metrics if line.startswith("fleet_gateway_overloaded_total "))
    assert float(overloaded.split()[1]) >= 2  # at least the two refusals asserted above
    http.close()
