"""A worker checks its Redis URL once: ``fleet worker`` in the CLI, a bare ``celery -A workers.app worker`` at
``worker_init`` (:mod:`producer.redis_preflight`).

Before, ``fleet worker`` checked in the CLI and then again at ``worker_init`` of the Celery it became (the same
process, after ``exec``): with Redis down a second ``PING`` (up to 2 s more) and the warning printed twice.

Real processes: nothing listens on the URL's port when both workers start; a real redis-server is then started
there. Each worker's warnings are counted once its log shows it past ``worker_init`` (its model loaded), before
Redis answers.
"""

from __future__ import annotations

import os
import signal
import sys
from functools import partial
from pathlib import Path

import pytest
import redis

from protocol.keys import WORKER_KEY_PREFIX
from tests.integration.ops_fixtures import OpsFleet, ops_fleet, ops_models, ops_redis, wait_until  # noqa: F401
from tools.redis_server import EmbeddedRedis, free_port

pytestmark = pytest.mark.timeout(240)

WARNING = "fleet worker: warning: cannot reach Redis"


def _logged(log: Path, text: str) -> bool:
    return text in log.read_text()


def test_each_way_to_start_a_worker_checks_redis_once(ops_fleet: OpsFleet) -> None:  # noqa: F811
    port = free_port()
    config = ops_fleet.config(redis_url=f"redis://127.0.0.1:{port}/0")
    env = {"FLEET_CONFIG": str(config)}
    fleet_worker = ops_fleet.spawn([sys.executable, "-m", "producer.cli", "worker", "--config", str(config),
                                    "-n", "via-fleet@test"], env=env, name="via-fleet")  # fmt: skip
    fleet_log = ops_fleet.tmp_path / f"via-fleet-{ops_fleet._n}.log"
    bare = ops_fleet.spawn([sys.executable, "-m", "celery", "-A", "workers.app", "worker", "-P", "threads", "-c", "8",
                            "-Q", "fleet.demo-lm", "-n", "bare-celery@test", "--without-gossip", "--without-mingle"],
                           env=env, name="bare-celery")  # fmt: skip
    bare_log = ops_fleet.tmp_path / f"bare-celery-{ops_fleet._n}.log"
    for log, name in ((fleet_log, "via-fleet@test"), (bare_log, "bare-celery@test")):  # past worker_init, Redis down
        wait_until(partial(_logged, log, f"worker {name} serves model"), 90, f"{name} to load its model")
    counts = {log.name: log.read_text().count(WARNING) for log in (fleet_log, bare_log)}
    with EmbeddedRedis(port) as late:  # the workers then serve, and stop cleanly while their Redis is up
        client = redis.Redis.from_url(late.url)
        try:
            for name in ("via-fleet@test", "bare-celery@test"):
                wait_until(partial(client.exists, f"{WORKER_KEY_PREFIX}{name}"), 90, f"{name}'s heartbeat")
        finally:
            client.close()
        for proc in (fleet_worker, bare):
            assert proc.poll() is None
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
    assert counts == {fleet_log.name: 1, bare_log.name: 1}, counts
