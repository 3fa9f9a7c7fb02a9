"""Adversarial checks of the model-version lifecycle: changes that land while a worker is busy loading a version.

A worker fetches, verifies and warms a version up before it swaps it in; that takes seconds for a real model,
and an operator (or the canary guard) can change the state meanwhile. Here the store is frozen (SIGSTOP of the
real SeaweedFS) while the worker fetches, so the change lands during the load deterministically: the test waits
on Redis's MONITOR for the worker's read of the new state, never on a clock.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis

from producer.cli import main as fleet_main
from protocol.model_served import read_served
from protocol.model_state import STATE_KEY, history, pin, read_state, rollback, set_canary
from store import ModelStore
from store.s3 import S3Backend
from tests.integration.fleet_fixtures import Fleet
from tests.integration.lifecycle_fixtures import (
    BUCKET,
    Watch,
    collect,
    lifecycle_config,
    publish,
    send_to_role,
    wait_until,
)
from tests.integration.model_versions import MODEL
from tests.integration.redis_monitor import Monitor
from tools.processes import WorkerProcess
from tools.seaweed_server import EmbeddedSeaweed


@contextmanager
def _frozen(s3: EmbeddedSeaweed) -> Iterator[None]:
    """The store answers nothing while inside (its process stopped; connections queue in the kernel)."""
    assert s3.proc is not None
    os.kill(s3.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(s3.proc.pid, signal.SIGCONT)


def _change_during_load(monitor: Monitor, change: Callable[[], object], then: Callable[[], object]) -> None:
    """Apply ``change``; once the worker has read the state it wrote (so it is loading the version it names,
    blocked on the frozen store), apply ``then``."""
    state_key = STATE_KEY.format(model=MODEL)
    start = len(monitor.up_to_now())
    change()

    def worker_read_it() -> bool:
        commands = [c["command"] for c in monitor.commands[start:]]
        wrote = next((i for i, c in enumerate(commands) if c.startswith(f"SET {state_key} ")), None)
        return wrote is not None and f"GET {state_key}" in commands[wrote + 1:]

    wait_until(worker_read_it, 60, "the worker to read the changed state")
    then()


def _settled(worker: WorkerProcess, version: str, role: str) -> str:
    """Wait until the worker either swapped ``version`` in as ``role`` or discarded it; returns which line."""
    swapped, discarded = f"serves {MODEL} {version} as {role}", f"discards {MODEL} {version}"

    def outcome() -> str | None:
        tail = worker.log_tail(400_000)
        return swapped if swapped in tail else discarded if discarded in tail else None

    return str(wait_until(outcome, 60, f"the worker to finish loading {version}"))


def test_a_version_rolled_back_while_a_worker_loads_it_never_serves(
    fleet: Fleet, s3: EmbeddedSeaweed, tmp_path: Path
) -> None:
    stable, canary, pinned = (publish(s3, tmp_path, scale) for scale in (1.0, 2.0, 3.0))
    cfg = lifecycle_config(fleet, s3, stable.version, tmp_path / "cache")
    worker = fleet.worker(cfg, MODEL, hostname="w1-load-race@test")
    r = redis.Redis.from_url(fleet.redis_url)
    watch = Watch(fleet.redis_url, [worker.hostname])
    monitor = Monitor(fleet.redis_url)
    client = fleet.client(cfg)
    try:
        wait_until(lambda: watch.all_serve(stable.version, None), 60, "the worker to serve the first version")
        with _frozen(s3):  # the canary is rolled back while the worker fetches it
            _change_during_load(monitor, lambda: set_canary(r, MODEL, canary.version, 50, "test@race"),
                                lambda: rollback(r, MODEL, "test@race", reason="bad canary"))
        canary_line = _settled(worker, canary.version, "canary")
        with _frozen(s3):  # the pin is rolled back while the worker fetches the pinned version
            _change_during_load(monitor, lambda: pin(r, MODEL, pinned.version, "test@race"),
                                lambda: rollback(r, MODEL, "test@race", reason="wrong pin"))
        pin_line = _settled(worker, pinned.version, "stable")
        after = [send_to_role(client, role, f"after the rollbacks {role} {i}") for role in ("stable", "canary")
                 for i in range(4)]
        results, failures = collect(client, after)
    finally:
        watch.stop()
        monitor.close()
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
    store = ModelStore(S3Backend(BUCKET, endpoint_url=s3.endpoint_url, client=s3.client()), tmp_path / "store")
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
