"""A worker without a model store serves a pin or a canary of its configured file's version.

``fleet models pin|canary`` allow that one version without a store (any other exits 2); a real worker
must then serve it, not refuse it (ConfigError: no model store is configured), both while it runs and
when it starts under that state.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from producer.cli import main as fleet_main
from protocol.keys import WORKER_KEY_PREFIX
from protocol.messages import InferenceResult
from protocol.model_state import read_state, refusals
from tests.integration.fleet_fixtures import Fleet
from tests.integration.lifecycle_fixtures import collect, wait_until

MODEL = "demo-lm"
CONFIGURED = "1.0.0"
"""The version in the card of the demo model the base config serves from its file."""


def _cli(capsys: pytest.CaptureFixture[str], config: Path, *argv: str) -> tuple[int, dict[str, object], str]:
    code = fleet_main(["models", *argv, "--config", str(config)])
    out = capsys.readouterr()
    return code, json.loads(out.out.strip().splitlines()[-1]), out.err


def _beat(r: redis.Redis[bytes], host: str) -> dict[str, object]:
    doc: dict[str, object] = json.loads(r.get(WORKER_KEY_PREFIX + host) or b"{}")
    return doc


def test_a_worker_without_a_store_serves_a_pin_and_a_canary_of_its_configured_version(
    fleet: Fleet, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = fleet.config()
    worker = fleet.worker(cfg, MODEL, hostname="w1-storeless@test")
    r = redis.Redis.from_url(fleet.redis_url)
    assert _beat(r, worker.hostname).get("version") == CONFIGURED

    code, doc, err = _cli(capsys, cfg, "pin", MODEL, CONFIGURED, "--wait-s", "30")
    assert code == 0 and doc["served"] == {CONFIGURED: [worker.hostname]} and doc["not_served"] is None, (doc, err)
    # a worker that starts under the pin serves it too (the running one has applied it by then, or refused it)
    worker.stop()
    worker = fleet.worker(cfg, MODEL, hostname="w1-storeless@test")
    assert _beat(r, worker.hostname).get("version") == CONFIGURED, worker.log_tail(4000)
    assert refusals(r, MODEL) == [], [f"{x.worker}: {x.error_type}: {x.error}" for x in refusals(r, MODEL)]

    # unpinned, then a canary of the same version (a canary may not be the pinned version): loaded as the canary
    assert _cli(capsys, cfg, "rollback", MODEL)[0] == 0
    code, doc, err = _cli(capsys, cfg, "canary", MODEL, CONFIGURED, "--weight", "50")
    assert code == 0, err
    wait_until(lambda: _beat(r, worker.hostname).get("canary_version") == CONFIGURED or refusals(r, MODEL), 60,
               "the worker to load the canary or refuse it")
    assert refusals(r, MODEL) == [], [f"{x.worker}: {x.error_type}: {x.error}" for x in refusals(r, MODEL)]
    assert "refuses" not in worker.log_tail(200_000)

    client = fleet.client(cfg)
    ids = [client.send(client.build_request(MODEL, [5, 6 + i], top_k=1), role=role)
           for i in range(4) for role in ("stable", "canary")]
    results, failures = collect(client, ids)
    assert not failures and {(x.version, x.role) for x in results if isinstance(x, InferenceResult)} == \
        {(CONFIGURED, "stable"), (CONFIGURED, "canary")}

    capsys.readouterr()
    assert fleet_main(["status", "--json", "--config", str(cfg)]) == 0
    row = next(m for m in json.loads(capsys.readouterr().out)["models"] if m["model"] == MODEL)
    assert row["not_served"] is None and row["last_refusals"] == [], row
    state = read_state(r, MODEL)
    assert state is not None and (state.stable, state.canary) == (None, CONFIGURED)
