"""A rollback is instant even while a worker is busy loading another version.

A load (fetch, verify, open, warm up) takes seconds for a real model; a change that needs none (the canary
dropped by `fleet models rollback` or by the guard, stable returned to a version the worker has cached) must
not wait for it. The store is frozen (SIGSTOP of the real SeaweedFS) while the worker fetches a version, so
the unrelated load is in flight for as long as the test needs: everything asserted inside ``_frozen`` happened
while that load could not end. The test waits on Redis's MONITOR and on heartbeats, never on a clock.
"""

from __future__ import annotations

from pathlib import Path

from producer.client import FleetClient
from protocol.model_state import history, pin, promote, read_state, rollback, set_canary
from tests.integration.fleet_fixtures import Fleet
from tests.integration.lifecycle_fixtures import collect, publish, send_to_role, served_roles, wait_until
from tests.integration.load_race_fixtures import change_during_load, frozen, one_worker, settled
from tests.integration.model_versions import MODEL
from tools.seaweed_server import EmbeddedSeaweed

DROP_S = 30
"""How long a drop may take before the test fails: only a worker that waits for the frozen load reaches it."""


def _roles(client: FleetClient, roles: tuple[str, ...], tag: str) -> set[tuple[str, str | None]]:
    """(version, role) of 3 requests sent straight to each of ``roles``' queues; fails on any failure."""
    return served_roles(client, [send_to_role(client, role, f"{tag} {role} {i}") for role in roles for i in range(3)])


def test_a_canary_rolled_back_during_a_stable_load_leaves_the_canary_queue_at_once(
    fleet: Fleet, s3: EmbeddedSeaweed, tmp_path: Path
) -> None:
    stable, canary, pinned = (publish(s3, tmp_path, scale) for scale in (1.0, 2.0, 3.0))
    with one_worker(fleet, s3, tmp_path, stable.version, "w1-instant@test") as one:
        worker, r, watch, monitor, client = one.worker, one.redis, one.watch, one.monitor, one.client
        set_canary(r, MODEL, canary.version, 50, "test@instant")
        wait_until(lambda: watch.all_serve(stable.version, canary.version), 60, "the worker to load the canary")
        with frozen(s3):  # a new stable version is loading (blocked on the store) when the canary is rolled back
            change_during_load(monitor, lambda: pin(r, MODEL, pinned.version, "test@instant"),
                               lambda: rollback(r, MODEL, "test@instant", reason="bad canary"))
            wait_until(lambda: watch.all_serve(stable.version, None), DROP_S,
                       "the worker to drop the rolled-back canary while the pinned version still loads")
            during = _roles(client, ("canary", "stable"), "while the pin loads")
        pin_line = settled(worker, pinned.version, "stable")
        after = _roles(client, ("canary", "stable"), "after the load")
    log = worker.log_tail(400_000)
    dropped_at, swapped_at = log.find("emptied its canary slot"), log.find(f"serves {MODEL} {pinned.version} as stable")
    print(f"\ncanary rolled back during a pin's load: served while the store was frozen {sorted(during)}; "
          f"then {pin_line!r}; after {sorted(after)}; canary dropped before the pin swapped in: "
          f"{0 <= dropped_at < swapped_at}")
    state = read_state(r, MODEL)
    assert state is not None and state.canary is None and state.stable == pinned.version
    assert during == {(stable.version, "stable")}, "the rolled-back canary served during an unrelated load"
    assert pin_line.startswith("serves"), "the pin, still in force, was not swapped in after its load"
    assert 0 <= dropped_at < swapped_at
    assert after == {(pinned.version, "stable")}


def test_the_guard_rolls_a_failing_canary_back_during_a_stable_load(
    fleet: Fleet, s3: EmbeddedSeaweed, tmp_path: Path
) -> None:
    stable, pinned = publish(s3, tmp_path, 1.0), publish(s3, tmp_path, 3.0)
    bad = publish(s3, tmp_path, 2.0, fail_on_real_input=True)
    bounds = {"window_s": 60, "min_requests": 4, "max_error_rate": 0.05, "check_interval_s": 0.5}
    with one_worker(fleet, s3, tmp_path, stable.version, "w1-guard-instant@test", canary=bounds) as one:
        worker, r, watch, monitor, client = one.worker, one.redis, one.watch, one.monitor, one.client
        set_canary(r, MODEL, bad.version, 50, "test@instant")
        wait_until(lambda: watch.all_serve(stable.version, bad.version), 60, "the worker to load the canary")
        with frozen(s3):  # the canary fails its requests while a new stable version is loading
            change_during_load(monitor, lambda: pin(r, MODEL, pinned.version, "test@instant"), lambda: None)
            failing = [send_to_role(client, "canary", f"failing canary {i}") for i in range(4)]
            _, failures = collect(client, failing)
            auto = wait_until(lambda: [h for h in history(r, MODEL) if h.action == "auto-rollback"], DROP_S,
                              "the guard to roll the failing canary back while the pinned version still loads")
            wait_until(lambda: watch.all_serve(stable.version, None), DROP_S, "the worker to drop the canary")
            during = _roles(client, ("canary",), "after the auto-rollback")
        pin_line = settled(worker, pinned.version, "stable")
    print(f"\nguard during a pin's load: {len(failures)} canary failures, then {auto[0].reason!r}; canary queue "
          f"while the store was frozen ran on {sorted(during)}; then {pin_line!r}")
    assert len(failures) == 4 and all("Gather" in f for f in failures)
    assert auto[0].by == "auto-rollback" and auto[0].from_.canary == bad.version
    assert during == {(stable.version, "stable")}
    assert pin_line.startswith("serves")


def test_a_pin_rolled_back_while_another_canary_loads_returns_stable_at_once(
    fleet: Fleet, s3: EmbeddedSeaweed, tmp_path: Path
) -> None:
    stable, pinned, canary = (publish(s3, tmp_path, scale) for scale in (1.0, 3.0, 2.0))
    with one_worker(fleet, s3, tmp_path, stable.version, "w1-unpin-instant@test") as one:
        worker, r, watch, monitor, client = one.worker, one.redis, one.watch, one.monitor, one.client
        pin(r, MODEL, pinned.version, "test@instant")
        wait_until(lambda: watch.all_serve(pinned.version, None), 60, "the worker to serve the pin")
        with frozen(s3):  # a canary is loading (blocked on the store) when the pin is rolled back
            change_during_load(monitor, lambda: set_canary(r, MODEL, canary.version, 50, "test@instant"),
                               lambda: rollback(r, MODEL, "test@instant", reason="bad canary"))
            rollback(r, MODEL, "test@instant", reason="bad pin")  # to the configured version, in the worker's cache
            wait_until(lambda: watch.all_serve(stable.version, None), DROP_S,
                       "the worker to return to its cached stable version while the canary still loads")
            during = _roles(client, ("canary", "stable"), "while the canary loads")
        canary_line = settled(worker, canary.version, "canary")
    print(f"\npin rolled back while a canary loads: served while the store was frozen {sorted(during)}; "
          f"then {canary_line!r}")
    state = read_state(r, MODEL)
    assert state is not None and state.canary is None and state.stable is None
    assert during == {(stable.version, "stable")}, "a rolled-back pin served during an unrelated canary load"
    assert canary_line.startswith("discards"), "a rolled-back canary was swapped in after its load"


def test_a_canary_promoted_during_its_load_becomes_stable_without_a_reload(
    fleet: Fleet, s3: EmbeddedSeaweed, tmp_path: Path
) -> None:
    stable, canary = publish(s3, tmp_path, 1.0), publish(s3, tmp_path, 2.0)
    with one_worker(fleet, s3, tmp_path, stable.version, "w1-promote-load@test") as one:
        worker, r, watch, monitor, client = one.worker, one.redis, one.watch, one.monitor, one.client
        with frozen(s3):  # the canary is promoted while the worker fetches it
            change_during_load(monitor, lambda: set_canary(r, MODEL, canary.version, 50, "test@instant"),
                               lambda: promote(r, MODEL, "test@instant"))
        wait_until(lambda: watch.all_serve(canary.version, None), 60, "the worker to serve the promoted version")
        after = _roles(client, ("canary", "stable"), "after the promotion")
    log = worker.log_tail(400_000)
    loads = log.count(f"loaded {MODEL} {canary.version} ")
    print(f"\ncanary promoted during its load: loaded {loads} time(s); served after {sorted(after)}")
    assert f"discards {MODEL} {canary.version}" not in log and loads == 1, "the promoted canary was loaded twice"
    assert after == {(canary.version, "stable")}
