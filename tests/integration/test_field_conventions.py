"""What tools of the field expect from an inference server: ``GET /health``, ``fleet --version``, JSON log
lines carrying the request ID, and Redis URLs that show a mask only where there is a password.

Real processes throughout: one Redis, a ``fleet api`` and a demo-lm worker with ``log.format: json``, and
a demo-encoder worker logging plain text (its start-up banner is where Celery prints the broker URL).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.ops_fixtures import API_KEY, ROOT, OpsFleet, ops_models, ops_redis, wait_until
from tests.integration.test_flower import PASSWORD, USER, Flower
from tools.processes import WorkerProcess
from tools.redis_server import EmbeddedRedis, free_port

__all__ = ["ops_models", "ops_redis"]

AUTH = {"X-API-Key": API_KEY}


@dataclass
class JsonFleet:
    url: str
    gateway_log: Path
    lm_worker: WorkerProcess


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, ops_models: Any, ops_redis: EmbeddedRedis) -> Iterator[OpsFleet]:
    fleet = OpsFleet(tmp_path_factory.mktemp("conventions"), ops_models, ops_redis)
    try:
        yield fleet
    finally:
        fleet.close()


@pytest.fixture(scope="module")
def text_worker(fleet: OpsFleet) -> WorkerProcess:
    """A demo-encoder worker logging plain text (the default)."""
    return fleet.worker(fleet.config(), "demo-encoder")


@pytest.fixture(scope="module")
def json_fleet(fleet: OpsFleet) -> JsonFleet:
    """A demo-lm worker and a ``fleet api`` (access log on) with ``log.format: json``."""
    json_config = fleet.config(log={"format": "json"})
    lm_worker = fleet.worker(json_config, "demo-lm")
    port = free_port()
    cmd = [sys.executable, "-m", "producer.cli", "api", "--config", str(json_config), "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "info"]  # fmt: skip
    proc = fleet.spawn(cmd, name="gateway")
    gateway_log = fleet.tmp_path / f"gateway-{fleet._n}.log"  # spawn's log file
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.poll() is None, f"the gateway exited: {gateway_log.read_text()[-2000:]}"
        try:
            return httpx.get(url + "/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, 30, "the gateway")
    return JsonFleet(url, gateway_log, lm_worker)


def _json_lines(path: Path) -> list[dict[str, Any]]:
    """Every line of a log file, each parsed as JSON (the test fails on the first line that is not)."""
    docs = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                docs.append(json.loads(line))
            except ValueError:
                pytest.fail(f"{path.name}: a line that is not JSON: {line[:300]!r}")
    return docs


def test_health_answers_200_with_an_empty_body_and_says_nothing_about_readiness(fleet: OpsFleet) -> None:
    gateway = fleet.gateway(fleet.config(serve=("demo-lm",)))  # no worker: not ready, yet alive
    resp = httpx.get(gateway.url + "/health")
    assert resp.status_code == 200 and resp.content == b""
    assert httpx.get(gateway.url + "/healthz").status_code == 200  # the old name stays
    assert httpx.get(gateway.url + "/readyz").status_code == 503
    assert "/health" in httpx.get(gateway.url + "/openapi.json").json()["paths"]


def test_fleet_version_prints_the_installed_version() -> None:
    done = subprocess.run([sys.executable, "-m", "producer.cli", "--version"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"fleet (onnx-fleet) {version('onnx-fleet')}"


def test_json_logs_carry_the_request_id_on_access_and_worker_lines(json_fleet: JsonFleet) -> None:
    http = httpx.Client(base_url=json_fleet.url, headers=AUTH, timeout=30)
    submitted = http.post("/v1/requests", json={"model": "demo-lm", "input_ids": [5, 6, 7]})
    assert submitted.status_code == 202, submitted.text
    rid = submitted.json()["request_id"]
    wait_until(lambda: http.get(f"/v1/requests/{rid}").json()["status"] == "succeeded", 60, f"{rid} to succeed")
    completion = http.post("/v1/completions", json={"model": "demo-lm", "prompt": [5, 6], "max_tokens": 2})
    assert completion.status_code == 200, completion.text
    openai_rid = completion.headers["X-Request-ID"]

    def access_lines() -> list[dict[str, Any]] | None:
        lines = [d for d in _json_lines(json_fleet.gateway_log) if d["logger"] == "fleet.access"]
        return lines if any(d.get("request_id") == openai_rid for d in lines) else None

    access = wait_until(access_lines, 10, "the completion's access line")
    by_request = {(d["method"], d["path"].split("?")[0]): d for d in access}
    assert by_request[("POST", "/v1/requests")]["request_id"] == rid
    assert by_request[("GET", f"/v1/requests/{rid}")]["request_id"] == rid
    assert by_request[("POST", "/v1/completions")]["request_id"] == openai_rid
    assert by_request[("POST", "/v1/requests")]["status"] == 202
    assert all({"ts", "level", "message", "duration_ms", "client"} <= d.keys() for d in access)

    def worker_lines() -> list[dict[str, Any]] | None:
        lines = _json_lines(json_fleet.lm_worker.log_path or Path("/nonexistent"))
        about = [d for d in lines if d.get("request_id") == rid]
        return lines if any("succeeded" in d["message"] for d in about) else None

    lines = wait_until(worker_lines, 30, f"the worker's line saying {rid} succeeded")
    about = [d["message"] for d in lines if d.get("request_id") == rid]
    assert any("received" in m for m in about), about
    for d in lines:  # a line naming a request's task ID is tagged with it
        if rid in d["message"]:
            assert d.get("request_id") == rid, d
    banner = [d["message"] for d in lines if "transport redis://" in d["message"]]  # the banner, as one line
    assert banner and all(":**@" not in m and ":***@" not in m for m in banner), banner


def test_a_redis_url_without_a_password_is_shown_without_a_mask(fleet: OpsFleet, text_worker: WorkerProcess) -> None:
    assert fleet.redis_url.startswith("redis://127.0.0.1:")  # no password: nothing to mask
    text = (text_worker.log_path or Path("/nonexistent")).read_text()
    assert "redis://127.0.0.1:" in text  # the banner's transport and Celery's "Connected to"
    assert ":**@" not in text and ":***@" not in text, [line for line in text.splitlines() if "**@" in line]


def test_flowers_broker_line_shows_no_mask_without_a_password(fleet: OpsFleet, tmp_path: Path) -> None:
    config = fleet.config(flower={"port": free_port(), "basic_auth": [f"{USER}:{PASSWORD}"]})
    flower = Flower(fleet, config, tmp_path / "flower.db")
    log_path = fleet.tmp_path / f"flower-{fleet._n}.log"  # spawn's log file
    try:
        flower.wait_up()
        broker = [line for line in log_path.read_text().splitlines() if "Broker:" in line]
        assert broker and "redis://127.0.0.1:" in broker[0], broker
        assert ":**@" not in broker[0] and ":***@" not in broker[0], broker
    finally:
        flower.stop()
