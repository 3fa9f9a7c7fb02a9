"""Helpers for the tests of version changes that land while a worker is busy loading a version.

The store is frozen (SIGSTOP of the real SeaweedFS) while the worker fetches a version, so the load is in
flight for as long as a test needs; the tests wait on Redis's MONITOR for the worker's read of the changed
state and on heartbeats, never on a clock. :func:`one_worker` is their common setup: one worker on the
store's first version, with a heartbeat :class:`Watch`, a MONITOR and a client.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from producer.client import FleetClient
from protocol.model_state import STATE_KEY
from tests.integration.fleet_fixtures import Fleet
from tests.integration.lifecycle_fixtures import Watch, lifecycle_config, wait_until
from tests.integration.model_versions import MODEL
from tests.integration.redis_monitor import Monitor
from tools.processes import WorkerProcess
from tools.seaweed_server import EmbeddedSeaweed

__all__ = ["OneWorker", "change_during_load", "frozen", "one_worker", "settled"]


@contextmanager
def frozen(s3: EmbeddedSeaweed) -> Iterator[None]:
    """The store answers nothing while inside (its process stopped; connections queue in the kernel)."""
    assert s3.proc is not None
    os.kill(s3.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(s3.proc.pid, signal.SIGCONT)


def change_during_load(monitor: Monitor, change: Callable[[], object], then: Callable[[], object]) -> None:
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


def settled(worker: WorkerProcess, version: str, role: str) -> str:
    """Wait until the worker either swapped ``version`` in as ``role`` or discarded it; returns which line."""
    swapped, discarded = f"serves {MODEL} {version} as {role}", f"discards {MODEL} {version}"

    def outcome() -> str | None:
        tail = worker.log_tail(400_000)
        return swapped if swapped in tail else discarded if discarded in tail else None

    return str(wait_until(outcome, 60, f"the worker to finish loading {version}"))


@dataclass(frozen=True)
class OneWorker:
    """One worker serving the identity model from the store, and what a test watches it with."""

    worker: WorkerProcess
    redis: redis.Redis[bytes]
    watch: Watch
    monitor: Monitor
    client: FleetClient


@contextmanager
def one_worker(fleet: Fleet, s3: EmbeddedSeaweed, tmp_path: Path, first: str, hostname: str,
               **model: Any) -> Iterator[OneWorker]:
    """A worker named ``hostname`` on store version ``first`` (``model`` merges into its model's config, e.g.
    ``canary={...}``); the watch and the MONITOR stop when the block ends."""
    cfg = lifecycle_config(fleet, s3, first, tmp_path / "cache", **model)
    worker = fleet.worker(cfg, MODEL, hostname=hostname)
    watch, monitor = Watch(fleet.redis_url, [worker.hostname]), Monitor(fleet.redis_url)
    try:
        yield OneWorker(worker, redis.Redis.from_url(fleet.redis_url), watch, monitor, fleet.client(cfg))
    finally:
        watch.stop()
        monitor.close()
