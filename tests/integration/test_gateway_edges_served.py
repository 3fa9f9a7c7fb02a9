"""Smaller gateway defects testers found, on real ``fleet api`` processes (uvicorn, httptools) and a real Redis, no
worker: ``/readyz`` with no model configured, paths that are no route, ``Prefer: wait`` and ``wait_s`` values
that are not digits, and ``wait_s`` on the batch route. The same answers as pure app logic:
``tests/unit/test_gateway_edges.py``.

Before: ``/readyz`` on a config with ``models: {}`` answered 200 ``ready`` (``fleet probe ready`` fails there);
``POST /v1/chat/completions/`` was a bare ``307``; ``//v1/models`` a 404 in the native shape; ``Prefer: wait=1_0``
held the submit 10 s (``float("1_0")``); ``?wait_s=1_0`` waited 10 s; ``POST /v1/requests:batch?wait_s=5`` queued
the batch and answered 202 without waiting.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.ops_routes import NO_MODELS_PROBLEM
from tests.integration.ops_fixtures import (
    API_KEY,
    ROOT,
    GatewayProcess,
    lone_gateway,
    ops_models,
    ops_redis,
)
from tools.processes import log_since
from tools.redis_server import EmbeddedRedis

__all__ = ["ops_models", "ops_redis"]

pytestmark = pytest.mark.timeout(300)

AUTH = {"X-API-Key": API_KEY}
QUEUE = "fleet.demo-lm"
GENERATION = {"model": "demo-lm", "input_ids": [5, 6], "output": {"generation": {"max_new_tokens": 4}}}


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, ops_models: Any, ops_redis: EmbeddedRedis
) -> Iterator[GatewayProcess]:
    yield from lone_gateway(tmp_path_factory, ops_models, ops_redis, "edges", {})


@pytest.fixture(scope="module")
def modelless(
    tmp_path_factory: pytest.TempPathFactory, ops_redis: EmbeddedRedis
) -> Iterator[tuple[GatewayProcess, Path]]:
    """A gateway whose config file configures no model (``models: {}``), on a Redis that answers; and the file."""
    folder = tmp_path_factory.mktemp("modelless")
    config = folder / "fleet.yaml"
    config.write_text(yaml.safe_dump({"redis_url": ops_redis.url, "models": {}, "api": {"api_keys": [API_KEY]}}))
    gw = GatewayProcess(config, folder / "gateway.log")
    try:
        yield gw.wait_ready(), config
    finally:
        gw.stop()


def test_readyz_with_no_model_configured_fails_as_the_probe_does(modelless: tuple[GatewayProcess, Path]) -> None:
    gw, config = modelless
    for answer in (httpx.get(gw.url + "/readyz", timeout=30), httpx.head(gw.url + "/readyz", timeout=30)):
        assert answer.status_code == 503, answer.text
    assert httpx.get(gw.url + "/readyz", timeout=30).json() == {"ready": False, "problems": [NO_MODELS_PROBLEM]}
    said = f"no models configured: {config} has none under models"  # fleet probe ready's words, in the log
    assert said in log_since(gw.log_path, 0), log_since(gw.log_path, 0)[-2000:]
    probe = subprocess.run([sys.executable, "-m", "producer.ops_cli", "probe", "ready", "--config", str(config)],
                           cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert probe.returncode == 1 and said in probe.stderr, probe.stderr


def test_no_path_is_redirected(gateway: GatewayProcess) -> None:
    """A client that follows a 307 may send the POST again without its body; the OpenAI SDK raises on it."""
    answer = httpx.post(gateway.url + "/v1/chat/completions/", headers=AUTH, timeout=30,
                        json={"model": "demo-lm", "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    assert answer.status_code == 404 and "location" not in answer.headers, (answer.status_code, answer.headers)
    assert "the route is /v1/chat/completions " in answer.json()["error"]["message"], answer.text
    doubled = httpx.get(gateway.url + "//v1/models", headers=AUTH, timeout=30)
    assert doubled.status_code == 404 and doubled.json()["error"]["code"] == "not_found", doubled.text
    assert "no route is at //v1/models;" in doubled.json()["error"]["message"], doubled.text
    bare = httpx.get(gateway.url + "/v1", headers=AUTH, timeout=30)
    assert bare.status_code == 404 and bare.json()["error"]["code"] == "not_found", bare.text
    native = httpx.get(gateway.url + "/healthz/", timeout=30)
    assert native.status_code == 404 and native.json()["error"] == "not_found", native.text


def test_a_wait_that_is_not_digits_is_not_read_as_a_number(gateway: GatewayProcess, ops_redis: EmbeddedRedis) -> None:
    """``Prefer`` is a hint: one that cannot be read is ignored (202 at once, no ``Preference-Applied``);
    ``wait_s`` is the caller's parameter: 422 naming it, nothing queued."""
    redis = ops_redis.client()
    started = time.monotonic()
    hinted = httpx.post(gateway.url + "/v1/requests", json=GENERATION, headers={**AUTH, "Prefer": "wait=1_0"},
                        timeout=60)  # fmt: skip
    assert hinted.status_code == 202 and "preference-applied" not in hinted.headers, (hinted.text, hinted.headers)
    assert time.monotonic() - started < 5, "the submit waited: wait=1_0 was read as 10 s"
    read = httpx.post(gateway.url + "/v1/requests", json=GENERATION, headers={**AUTH, "Prefer": "wait=0.2"},
                      timeout=60)  # fmt: skip
    assert read.status_code == 202 and read.headers["preference-applied"] == "wait=0.2", read.headers
    queued = redis.llen(QUEUE)
    for value in ("1_0", "+1", "nan"):
        answer = httpx.post(gateway.url + "/v1/requests", params={"wait_s": value}, json=GENERATION, headers=AUTH,
                            timeout=60)  # fmt: skip
        assert answer.status_code == 422 and answer.json()["field"] == "wait_s", answer.text
        polled = httpx.get(f"{gateway.url}/v1/requests/{hinted.json()['request_id']}", params={"wait_s": value},
                           headers=AUTH, timeout=60)  # fmt: skip
        assert polled.status_code == 422 and polled.json()["field"] == "wait_s", polled.text
    assert redis.llen(QUEUE) == queued


def test_a_batch_refuses_wait_s_and_queues_nothing(gateway: GatewayProcess, ops_redis: EmbeddedRedis) -> None:
    redis = ops_redis.client()
    queued = redis.llen(QUEUE)
    answer = httpx.post(gateway.url + "/v1/requests:batch", params={"wait_s": "5"}, headers=AUTH, timeout=60,
                        json={"requests": [GENERATION, GENERATION]})  # fmt: skip
    assert answer.status_code == 422, answer.text
    assert answer.json()["field"] == "wait_s" and "GET /v1/requests/{id}?wait_s=" in answer.json()["message"]
    assert redis.llen(QUEUE) == queued
    plain = httpx.post(gateway.url + "/v1/requests:batch", headers=AUTH, timeout=60, json={"requests": [GENERATION]})
    assert plain.status_code == 202 and redis.llen(QUEUE) == queued + 1, plain.text
