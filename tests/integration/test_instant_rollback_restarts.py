"""A canary survives the restarts around it: Redis (with its AOF) restarted mid-canary keeps the state and the
worker keeps serving both versions; a worker restarted mid-canary comes back on the pinned stable version and
the canary, the canary loaded before it takes its first request (requests queued while it was down included).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import redis

from producer.client import FleetClient
from protocol.model_state import history, pin, read_state, set_canary
from tests.integration.fleet_fixtures import Fleet
from tests.integration.lifecycle_fixtures import (
    Watch,
    lifecycle_config,
    publish,
    send_to_role,
    served_roles,
    wait_until,
)
from tests.integration.model_versions import MODEL
from tools.redis_server import EmbeddedRedis
from tools.seaweed_server import EmbeddedSeaweed


def _send(client: FleetClient, tag: str) -> list[str]:
    return [send_to_role(client, role, f"{tag} {role} {i}") for role in ("stable", "canary") for i in range(3)]


def test_a_redis_restart_with_aof_mid_canary_keeps_the_canary(
    tmp_path: Path, model_dir: Path, s3: EmbeddedSeaweed
) -> None:
    server = EmbeddedRedis(appendonly=True, data_dir=tmp_path / "redis")
    (tmp_path / "redis").mkdir()
    server.start()
    fleet = Fleet(tmp_path, model_dir, server.url)
    watch: Watch | None = None
    try:
        stable, canary = publish(s3, tmp_path, 1.0), publish(s3, tmp_path, 2.0)
        cfg = lifecycle_config(fleet, s3, stable.version, tmp_path / "cache")
        worker = fleet.worker(cfg, MODEL, hostname="w1-aof-canary@test")
        r = redis.Redis.from_url(fleet.redis_url)
        watch = Watch(fleet.redis_url, [worker.hostname])
        client = fleet.client(cfg)
        set_canary(r, MODEL, canary.version, 50, "test@restart")
        wait_until(lambda: watch is not None and watch.all_serve(stable.version, canary.version), 60,
                   "the worker to load the canary")
        before_state, before_history = read_state(r, MODEL), len(history(r, MODEL))
        before = served_roles(client, _send(client, "before the restart"))
        server.kill()  # a crash: what Redis wrote to its AOF is in the page cache
        server.start()
        after_state, after_history = read_state(r, MODEL), len(history(r, MODEL))
        after = served_roles(client, _send(client, "after the restart"))
        log = worker.log_tail(400_000)
    finally:
        if watch is not None:
            watch.stop()
        fleet.close()
        server.stop()
        shutil.rmtree(tmp_path / "redis", ignore_errors=True)
    print(f"\nRedis SIGKILL + restart (AOF) mid-canary: state {before_state} -> {after_state}; history "
          f"{before_history} -> {after_history} entries; served before {sorted(before)}, after {sorted(after)}")
    assert after_state == before_state and after_state is not None and after_state.canary == canary.version
    assert after_history == before_history == 1
    assert before == after == {(stable.version, "stable"), (canary.version, "canary")}
    assert "emptied its canary slot" not in log, "the worker dropped the canary across the restart"


def test_a_worker_restarted_mid_canary_serves_the_pinned_stable_and_the_canary(
    fleet: Fleet, s3: EmbeddedSeaweed, tmp_path: Path
) -> None:
    configured, pinned, canary = (publish(s3, tmp_path, scale) for scale in (1.0, 3.0, 2.0))
    cfg = lifecycle_config(fleet, s3, configured.version, tmp_path / "cache")
    hostname = "w1-restart-canary@test"
    first = fleet.worker(cfg, MODEL, hostname=hostname)
    r = redis.Redis.from_url(fleet.redis_url)
    watch = Watch(fleet.redis_url, [hostname])
    client = fleet.client(cfg)
    try:
        pin(r, MODEL, pinned.version, "test@restart")
        set_canary(r, MODEL, canary.version, 50, "test@restart")
        wait_until(lambda: watch.all_serve(pinned.version, canary.version), 60, "the worker to serve pin and canary")
        first_pid = watch.docs[hostname]["pid"]
        first.stop(timeout_s=15)
        queued = _send(client, "queued while the worker was down")  # taken by the new worker first of all
        fleet.worker(cfg, MODEL, hostname=hostname)
        served = served_roles(client, queued + _send(client, "after the restart"))
        doc = wait_until(lambda: watch.docs[hostname]["pid"] != first_pid and dict(watch.docs[hostname]), 30,
                         "the restarted worker's heartbeat")
    finally:
        watch.stop()
    print(f"\nworker restarted mid-canary: heartbeat version {doc['version']} canary {doc['canary_version']} "
          f"(pid {first_pid} -> {doc['pid']}); requests queued while down and after served on {sorted(served)}")
    assert (doc["version"], doc["canary_version"]) == (pinned.version, canary.version)
    assert served == {(pinned.version, "stable"), (canary.version, "canary")}
