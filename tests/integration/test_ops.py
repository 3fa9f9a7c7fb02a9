"""Operating the fleet: readiness (/readyz and ``fleet probe``), ``fleet status`` (Flower: test_flower.py)."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from producer.client import FleetClient
from protocol.settings import load_settings
from tests.integration.ops_fixtures import API_KEY, OpsFleet, ops_fleet, ops_models, ops_redis
from workers.health import list_workers

__all__ = ["ops_fleet", "ops_models", "ops_redis"]


def _probe(fleet: OpsFleet, config: Any, *args: str, full_cli: bool = False) -> int:
    module = "producer.cli" if full_cli else "producer.ops_cli"
    return fleet.fleet_cli(config, "probe", *args, module=module).returncode


def test_readyz_and_probe_follow_the_worker(ops_fleet: OpsFleet) -> None:
    config = ops_fleet.config(serve=("demo-lm",))
    gateway = ops_fleet.gateway(config)
    before = httpx.get(gateway.url + "/readyz")
    assert before.status_code == 503 and before.json()["problems"] == ["model 'demo-lm' has no worker"]
    assert _probe(ops_fleet, config, "ready", full_cli=True) == 1  # `fleet probe ready`
    assert _probe(ops_fleet, config, "ready") == 1  # `python -m producer.ops_cli probe ready`
    assert _probe(ops_fleet, config, "live") == 0  # the process may live on

    worker = ops_fleet.worker(config, wait=False)
    heartbeat = worker.wait_ready(60)
    assert heartbeat["ready"] is True and heartbeat["providers"] == ["CPUExecutionProvider"]
    after = httpx.get(gateway.url + "/readyz")
    assert after.status_code == 200 and after.json() == {"ready": True, "problems": []}
    # load balancers that probe with HEAD get the same answer, without a body (before: 405)
    for path in ("/readyz", "/healthz", "/health"):
        head = httpx.head(gateway.url + path)
        assert (head.status_code, head.content) == (200, b""), (path, head)
    assert _probe(ops_fleet, config, "ready", full_cli=True) == 0
    assert _probe(ops_fleet, config, "ready", "--worker", worker.hostname) == 0
    assert _probe(ops_fleet, config, "live", "--worker", worker.hostname) == 0
    assert _probe(ops_fleet, config, "live", "--worker", "nobody@nowhere") == 1

    worker.stop()  # a warm shutdown withdraws the heartbeat at once
    assert httpx.get(gateway.url + "/readyz").status_code == 503
    assert httpx.head(gateway.url + "/readyz").status_code == 503
    assert _probe(ops_fleet, config, "ready") == 1

    ops_fleet.server.kill()  # Redis gone: not ready; alive (restarting the probed process would not bring Redis back)
    try:
        down = httpx.get(gateway.url + "/readyz")
        assert down.status_code == 503 and "unreachable" in down.json()["problems"][0]
        assert _probe(ops_fleet, config, "ready") == 1
        assert _probe(ops_fleet, config, "live") == 0  # was 1: every worker's liveness failed with Redis
        assert _probe(ops_fleet, config, "live", "--worker", "nobody@nowhere") == 0  # whose heartbeat it cannot read
        submit = httpx.post(
            gateway.url + "/v1/requests", headers={"X-API-Key": API_KEY}, json={"model": "demo-lm", "input_ids": [1]}
        )
        assert submit.status_code == 503 and submit.headers["Retry-After"] == "5"
    finally:
        ops_fleet.server.start()


def test_status_shows_workers_and_queues(ops_fleet: OpsFleet) -> None:
    config = ops_fleet.config()
    worker = ops_fleet.worker(config)  # demo-lm only: demo-encoder requests wait in their queue
    client = FleetClient(load_settings(config))
    try:
        waiting = [client.submit("demo-encoder", [4, 5]) for _ in range(2)]
        done = client.result(client.submit("demo-lm", [1, 2, 3]), wait=True, timeout_s=30)
        assert done is not None and waiting
        # the heartbeat publishes batches_run every heartbeat_s: wait for the one after the batch
        deadline = time.monotonic() + 15
        while not any(w.get("batches_run", 0) >= 1 for w in list_workers(client.redis)):
            assert time.monotonic() < deadline, "heartbeat never reported the batch"
            time.sleep(0.05)
    finally:
        client.close()

    out = ops_fleet.fleet_cli(config, "status", "--json", module="producer.ops_cli")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    queues = {q["model"]: q for q in doc["queues"]}
    assert queues["demo-encoder"]["depth"] == 2 and queues["demo-encoder"]["ready_workers"] == 0
    assert queues["demo-encoder"]["oldest_waiting_s"] is not None and queues["demo-encoder"]["oldest_waiting_s"] >= 0
    assert queues["demo-lm"]["depth"] == 0 and queues["demo-lm"]["ready_workers"] == 1
    assert queues["demo-lm"]["drain_rate_per_s"] > 0
    [w] = doc["workers"]
    assert w["hostname"] == worker.hostname and w["ready"] is True and w["batches_run"] >= 1
    assert doc["problems"] == ["model 'demo-encoder' has no worker"]

    table = ops_fleet.fleet_cli(config, "status")
    assert table.returncode == 0, table.stderr
    text = table.stdout
    assert "WORKERS" in text and "QUEUES" in text and worker.hostname in text
    encoder_row = next(line for line in text.splitlines() if line.startswith("demo-encoder"))
    assert encoder_row.split()[:4] == ["demo-encoder", "fleet.demo-encoder", "2", "10000"]
    assert "NOT READY: model 'demo-encoder' has no worker" in text


def test_the_gateway_logs_its_own_lines_in_the_default_text_format(ops_fleet: OpsFleet) -> None:
    """With ``log.format: text`` (the default) only uvicorn's lines were written: the fleet's own (``fleet.api``:
    the start-up freeze, result notifications back after a Redis restart) had no handler."""
    gateway = ops_fleet.gateway(ops_fleet.config(), log_level="info")
    log = gateway.log_path.read_text()  # the freeze is logged before uvicorn starts listening (/healthz answered)
    assert "gateway: " in log and "start-up objects frozen out of the garbage collector" in log, log[-2000:]
