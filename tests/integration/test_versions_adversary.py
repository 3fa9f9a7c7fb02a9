"""Adversarial checks of the model-version lifecycle: changes that land while a worker is busy loading a version.

A worker fetches, verifies and warms a version up before it swaps it in; that takes seconds for a real model,
and an operator (or the canary guard) can change the state meanwhile. Here the store is frozen (SIGSTOP of the
real SeaweedFS) while the worker fetches, so the change lands during the load deterministically: the test waits
on Redis's MONITOR for the worker's read of the new state, never on a clock.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from producer.cli import main as fleet_main
from protocol.model_served import read_served
from protocol.model_state import history, pin, read_state, rollback, set_canary
from tests.integration.conftest import s3_model_store
from tests.integration.fleet_fixtures import Fleet
from tests.integration.lifecycle_fixtures import (
    collect,
    lifecycle_config,
    publish,
    send_to_role,
    wait_until,
)
from tests.integration.load_race_fixtures import change_during_load, frozen, one_worker, settled
from tests.integration.model_versions import MODEL
from tools.seaweed_server import EmbeddedSeaweed


def test_a_version_rolled_back_while_a_worker_loads_it_never_serves(
    fleet: Fleet, s3: EmbeddedSeaweed, tmp_path: Path
) -> None:
    stable, canary, pinned = (publish(s3, tmp_path, scale) for scale in (1.0, 2.0, 3.0))
    with one_worker(fleet, s3, tmp_path, stable.version, "w1-load-race@test") as one:
        worker, r, watch, monitor, client = one.worker, one.redis, one.watch, one.monitor, one.client
        wait_until(lambda: watch.all_serve(stable.version, None), 60, "the worker to serve the first version")
        with frozen(s3):  # the canary is rolled back while the worker fetches it
            change_during_load(monitor, lambda: set_canary(r, MODEL, canary.version, 50, "test@race"),
                               lambda: rollback(r, MODEL, "test@race", reason="bad canary"))
        canary_line = settled(worker, canary.version, "canary")
        with frozen(s3):  # the pin is rolled back while the worker fetches the pinned version
            change_during_load(monitor, lambda: pin(r, MODEL, pinned.version, "test@race"),
                               lambda: rollback(r, MODEL, "test@race", reason="wrong pin"))
        pin_line = settled(worker, pinned.version, "stable")
        after = [send_to_role(client, role, f"after the rollbacks {role} {i}") for role in ("stable", "canary")
                 for i in range(4)]
        results, failures = collect(client, after)
    served = {e.store_version for e in read_served(r, MODEL)}
    state = read_state(r, MODEL)
    print(f"\nload race: canary rolled back during its load -> {canary_line!r}; pin rolled back during its load -> "
          f"{pin_line!r}; versions recorded as served {sorted(v or '-' for v in served)}; state {state}")
    assert state is not None and state.canary is None and state.stable is None
    assert canary_line.startswith("discards"), "a rolled-back canary was swapped in after its load"
    assert pin_line.startswith("discards"), "a rolled-back pin was swapped in after its load"
    assert pinned.version not in served, "a version the state had rolled back was recorded as served"
    assert not failures and {(x.version, x.role) for x in results} == {(stable.version, "stable")}
    assert all(x.top_k is not None and abs(x.top_k[0].logprob - stable.logprob) < 1e-4 for x in results)


def test_a_rollback_refuses_to_return_to_a_version_deleted_from_the_store(
    fleet: Fleet, s3: EmbeddedSeaweed, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = publish(s3, tmp_path, 1.0), publish(s3, tmp_path, 2.0)
    store = s3_model_store(s3, tmp_path / "store")
    r = redis.Redis.from_url(fleet.redis_url)
    pin(r, MODEL, first.version, "ann@ops", store=store)
    pin(r, MODEL, second.version, "ann@ops", store=store)
    store.backend.delete(f"{MODEL}/{first.version}/manifest.json")  # unpublished: no worker can fetch it any more

    cfg = lifecycle_config(fleet, s3, first.version, tmp_path / "cli-cache")
    code = fleet_main(["models", "rollback", MODEL, "--config", str(cfg), "--reason", "p99"])
    captured = capsys.readouterr()
    err = captured.err
    print(f"\nfleet models rollback to a deleted version: exit {code}: {err}")
    assert code == 1 and json.loads(captured.out.splitlines()[-1])["type"] == "StateChangeRefused", captured
    assert f"cannot roll back from {second.version} to {first.version}" in err
    assert "no longer published" in err and f"fleet models pin {MODEL}" in err
    state = read_state(r, MODEL)
    assert state is not None and state.stable == second.version and len(history(r, MODEL)) == 2  # nothing changed

    # dropping a canary never asks the store, even for a canary that was deleted meanwhile
    set_canary(r, MODEL, first.version, 10, "ann@ops")
    assert rollback(r, MODEL, "ann@ops", store=store).to.canary is None
    # undoing a pin of the deleted version (recorded without the store check) returns to a published one
    pin(r, MODEL, first.version, "ann@ops")
    assert rollback(r, MODEL, "ann@ops", store=store).to.stable == second.version
