"""A load the desired state stops naming is superseded: it stops at its next step, and its replacement
does not wait for it.

The store is frozen (SIGSTOP of the real SeaweedFS) while a worker fetches a version, so that load is stuck
in a socket read for as long as a test needs; the state then moves on. A replacement the worker has cached
loads at once on a thread of its own (the superseded load still stuck); one that needs the store too starts
beside it, and loads when the store answers again, while the superseded load stops at the check after its
read. A third change while two superseded loads run waits until one of them ends (at most one abandoned
load per role). The tests wait on Redis's MONITOR, heartbeats and the worker's log lines, never on a clock. The last
one checks that a hung store does not hold a fetch for ever: it ends with a StoreError once the socket
timeouts and retries of :mod:`store.s3` are spent.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

import store.s3
from producer.client import FleetClient
from protocol.model_served import read_served
from protocol.model_state import pin
from store.errors import StoreError
from store.s3 import S3Backend
from tests.integration.fleet_fixtures import Fleet
from tests.integration.lifecycle_fixtures import BUCKET, publish, send_to_role, served_roles, wait_until
from tests.integration.load_race_fixtures import change_during_load, frozen, one_worker
from tests.integration.model_versions import MODEL
from tools.processes import WorkerProcess
from tools.seaweed_server import EmbeddedSeaweed
from workers.load_retry import transient

BY = "test@superseded"
SERVE_S = 30
"""How long the cached replacement may take to serve before the test fails: only a worker that waits for
the superseded load (stuck on the frozen store for minutes: :mod:`store.s3`'s timeouts) reaches it."""


def _line(worker: WorkerProcess, marker: str) -> str | None:
    """The first line of the worker's log holding ``marker``; None when there is none yet."""
    return next((line for line in worker.log_tail(400_000).splitlines() if marker in line), None)


def _await_line(worker: WorkerProcess, marker: str, what: str) -> str:
    return str(wait_until(lambda: _line(worker, marker), 60, what))


def _roles(client: FleetClient, tag: str) -> set[tuple[str, str | None]]:
    """(version, role) of 3 requests sent straight to each queue (stable, canary); fails on any failure."""
    return served_roles(client, [send_to_role(client, role, f"{tag} {role} {i}") for role in ("stable", "canary")
                                 for i in range(3)])


def test_a_pin_of_a_cached_version_serves_while_the_superseded_load_hangs_on_the_store(
    fleet: Fleet, s3: EmbeddedSeaweed, tmp_path: Path
) -> None:
    configured, first_pin, hung = (publish(s3, tmp_path, scale) for scale in (1.0, 2.0, 3.0))
    with one_worker(fleet, s3, tmp_path, configured.version, "w1-superseded-hung@test") as one:
        worker, r, watch, monitor, client = one.worker, one.redis, one.watch, one.monitor, one.client
        pin(r, MODEL, first_pin.version, BY)  # the configured version leaves service but stays in the cache
        wait_until(lambda: watch.all_serve(first_pin.version, None), 60, "the worker to serve the first pin")
        with frozen(s3):  # `hung` is loading, blocked in a read of the stopped store, when the operator pins back
            change_during_load(monitor, lambda: pin(r, MODEL, hung.version, BY),
                               lambda: pin(r, MODEL, configured.version, BY))
            wait_until(lambda: watch.all_serve(configured.version, None), SERVE_S,
                       "the worker to serve its cached version while the superseded load hangs on the frozen store")
            during = _roles(client, "while the superseded load hangs")
            stuck = _line(worker, f"discards {MODEL} {hung.version}") is None and \
                _line(worker, f"loaded {MODEL} {hung.version} ") is None
        ended = _await_line(worker, f"discards {MODEL} {hung.version}", "the superseded load to end")
        after = _roles(client, "after the store thaws")
    log = worker.log_tail(400_000)
    served = {e.store_version for e in read_served(r, MODEL)}
    print(f"\npin back to a cached version during a hung load: served while frozen {sorted(during)} (the superseded "
          f"load still stuck: {stuck}); then {ended!r}; after {sorted(after)}")
    assert during == {(configured.version, "stable")}
    assert stuck, "the superseded load ended while the store was frozen: the test proved nothing"
    assert "stopped as superseded" in ended
    assert f"serves {MODEL} {hung.version}" not in log and hung.version not in served
    assert after == {(configured.version, "stable")}


def test_a_superseded_load_stops_at_its_next_step_and_its_successor_serves(
    fleet: Fleet, s3: EmbeddedSeaweed, tmp_path: Path
) -> None:
    configured, superseded, successor = (publish(s3, tmp_path, scale) for scale in (1.0, 2.0, 3.0))
    cache = tmp_path / "cache" / MODEL
    with one_worker(fleet, s3, tmp_path, configured.version, "w1-superseded-stop@test") as one:
        worker, r, watch, monitor, client = one.worker, one.redis, one.watch, one.monitor, one.client
        wait_until(lambda: watch.all_serve(configured.version, None), 60, "the worker to serve its first version")
        with frozen(s3):  # the store is slow: both loads wait for it, the first already superseded
            change_during_load(monitor, lambda: pin(r, MODEL, superseded.version, BY),
                               lambda: pin(r, MODEL, successor.version, BY))
            _await_line(worker, f"abandons its load of {MODEL} {superseded.version} as stable",
                        "the worker to abandon the superseded load")
            _await_line(worker, f"loads {MODEL} {successor.version} as stable beside its abandoned load",
                        "the successor's load to begin beside the superseded one")
        stopped = _await_line(worker, f"discards {MODEL} {superseded.version}", "the superseded load to stop")
        wait_until(lambda: watch.all_serve(successor.version, None), 60, "the worker to serve the successor")
        after = _roles(client, "after the successor's load")
    log = worker.log_tail(400_000)
    leftovers = sorted(p.name for p in cache.glob(f".{superseded.version}.*"))
    print(f"\nsuperseded during a slow fetch: {stopped!r}; served after {sorted(after)}; "
          f"its leftovers in the cache: {leftovers}")
    assert "stopped as superseded after" in stopped
    assert f"{MODEL} {superseded.version}, loaded" not in log and f"loaded {MODEL} {superseded.version} " not in log
    assert f"serves {MODEL} {superseded.version}" not in log
    assert not leftovers and not (cache / superseded.version).exists()
    assert after == {(successor.version, "stable")}


def test_a_third_change_waits_while_two_superseded_loads_run(
    fleet: Fleet, s3: EmbeddedSeaweed, tmp_path: Path
) -> None:
    configured, first, second, third = (publish(s3, tmp_path, scale) for scale in (1.0, 2.0, 3.0, 4.0))
    with one_worker(fleet, s3, tmp_path, configured.version, "w1-superseded-bound@test") as one:
        worker, r, watch, monitor, client = one.worker, one.redis, one.watch, one.monitor, one.client
        wait_until(lambda: watch.all_serve(configured.version, None), 60, "the worker to serve its first version")
        with frozen(s3):
            change_during_load(monitor, lambda: pin(r, MODEL, first.version, BY),
                               lambda: pin(r, MODEL, second.version, BY))
            _await_line(worker, f"loads {MODEL} {second.version} as stable beside its abandoned load",
                        "the second load to begin beside the abandoned first")
            pin(r, MODEL, third.version, BY)  # the second is superseded too: the abandoned slot is taken
            waits = _await_line(worker, f"waits to load {MODEL} {third.version} as stable",
                                "the third load to wait for a superseded one to end")
            began_while_frozen = _line(worker, f"loads {MODEL} {third.version} as stable") is not None
        wait_until(lambda: watch.all_serve(third.version, None), 60, "the worker to serve the third pin")
        after = _roles(client, "after the third pin")
    log = worker.log_tail(400_000)
    ends = [log.find(f"discards {MODEL} {v.version}") for v in (first, second)]
    third_begins = log.find(f"loads {MODEL} {third.version} as stable")
    print(f"\nthree pins during a frozen fetch: {waits!r}; the third began after a superseded load ended: "
          f"{0 <= min(ends) < third_begins}; served after {sorted(after)}")
    assert not began_while_frozen, "a third load began while two superseded loads of its role ran"
    assert min(ends) >= 0 and min(ends) < third_begins, "the third load began before a superseded one ended"
    assert f"serves {MODEL} {first.version}" not in log and f"serves {MODEL} {second.version}" not in log
    assert after == {(third.version, "stable")}


def test_a_hung_store_ends_a_read_and_a_stalled_download_with_a_store_error(
    s3: EmbeddedSeaweed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    version = publish(s3, tmp_path, 1.0).version
    monkeypatch.setattr(store.s3, "READ_TIMEOUT_S", 0.5)  # 60 s in service: the attempts are the same
    backend = S3Backend(BUCKET, endpoint_url=s3.endpoint_url)
    manifest, big = f"{MODEL}/{version}/manifest.json", f"{MODEL}/{version}/big.bin"
    (tmp_path / "big.bin").write_bytes(os.urandom(32 << 20))  # more than the sockets' buffers hold
    backend.upload(big, tmp_path / "big.bin")
    with frozen(s3), pytest.raises(StoreError) as read:  # connections are accepted (the backlog), never answered
        backend.read(manifest)
    assert s3.proc is not None
    stalled = threading.Event()

    def stall(_n: int) -> None:  # the body began to arrive: the store stops in the middle of it
        if not stalled.is_set():
            stalled.set()
            os.kill(s3.proc.pid, signal.SIGSTOP)

    try:
        with pytest.raises(StoreError) as download:
            backend.download(big, tmp_path / "big.copy", stall)
    finally:
        os.kill(s3.proc.pid, signal.SIGCONT)
    print(f"\na hung store: read -> {read.value}; a download stalled in its body -> {download.value}")
    assert "timeout" in str(read.value).lower() and read.value.field == manifest
    assert stalled.is_set() and download.value.field == big
    assert transient(read.value) and transient(download.value)  # the reconciler tries such a load again
