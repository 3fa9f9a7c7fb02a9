"""A request for a model no live worker serves is accepted (a fleet scaled to zero starts on its queue)
and said everywhere the caller looks: the gateway's 202 answer, the status by ID, and the OpenAI routes'
wait, which ends after ``api.no_worker_wait_s`` with a 503 (a stream: an error chunk) that names the
model and how to start a worker (the CLI's side: test_unhappy_paths.py). Real gateway, real worker, real Redis."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.integration.ops_fixtures import API_KEY, OpsFleet, ops_fleet, ops_models, ops_redis  # noqa: F401

pytestmark = pytest.mark.timeout(240)
HEADERS = {"X-API-Key": API_KEY}


def test_no_worker_is_said_by_the_gateway(ops_fleet: OpsFleet) -> None:  # noqa: F811
    config = ops_fleet.config(api={"no_worker_wait_s": 1.0})
    ops_fleet.worker(config, "demo-encoder")  # demo-lm has no worker
    gw = ops_fleet.gateway(config)
    http = httpx.Client(base_url=gw.url, headers=HEADERS, timeout=60)

    accepted = http.post("/v1/requests", json={"model": "demo-lm", "input_ids": [5, 6, 7], "request_id": "nw-gw-1"})
    assert accepted.status_code == 202, accepted.text
    assert "no live worker serves model 'demo-lm'" in accepted.json()["warning"], accepted.text
    assert "fleet worker --model demo-lm" in accepted.json()["warning"]
    view = http.get("/v1/requests/nw-gw-1").json()
    assert view["status"] == "queued" and "no live worker serves model 'demo-lm'" in view["warning"], view
    batch = http.post("/v1/requests:batch", json={"requests": [{"model": "demo-lm", "input_ids": [5]},
                                                               {"model": "demo-encoder", "text": "served"}]})
    assert batch.status_code == 202, batch.text
    lm_item, encoder_item = batch.json()["requests"]
    assert "demo-lm" in lm_item["warning"] and "warning" not in encoder_item, batch.text

    done = http.post("/v1/completions", json={"model": "demo-lm", "prompt": "Hello", "max_tokens": 4})
    assert done.status_code == 503, done.text
    error: dict[str, Any] = done.json()["error"]
    assert error["code"] == "no_worker" and "no live worker serves model 'demo-lm'" in error["message"], error
    assert "fleet worker --model demo-lm" in error["message"] and "cancelled" in error["message"], error
    rid = done.headers["X-Request-ID"]
    assert http.get(f"/v1/requests/{rid}").json()["status"] == "cancelled"  # nothing runs for a caller told no
    streamed = http.post("/v1/chat/completions", json={"model": "demo-lm", "stream": True, "max_tokens": 4,
                                                       "messages": [{"role": "user", "content": "Hi"}]})
    assert streamed.status_code == 200, streamed.text  # a stream opens at once; its silence is bounded
    frames = [line.removeprefix("data: ") for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]" and json.loads(frames[-2])["error"]["code"] == "no_worker", frames
    assert "no live worker serves model 'demo-lm'" in json.loads(frames[-2])["error"]["message"], frames
    assert http.get(f"/v1/requests/{streamed.headers['X-Request-ID']}").json()["status"] == "cancelled"

    served = http.post("/v1/embeddings", json={"model": "demo-encoder", "input": "a served model"})
    assert served.status_code == 200, served.text  # a live worker: no bound, no warning
    plain = http.post("/v1/requests", json={"model": "demo-encoder", "text": "served"})
    assert plain.status_code == 202 and "warning" not in plain.json(), plain.text
