"""A worker started with Celery's own command, as the README says works, behaves as ``fleet worker``.

``fleet worker`` passes ``--without-mingle --without-gossip``; ``celery -A workers.app worker …`` without them
had mingle ask the other workers hello at start, and their replies (``<id>.reply.celery.pidbox``, a list the
worker takes from) went through the poison guard, which dead-lettered each as ``bad_headers``.
"""

from __future__ import annotations

import redis

from protocol.keys import DEAD_LETTER_KEY
from protocol.settings import load_settings
from tests.integration.fleet_fixtures import Fleet
from tools.processes import WorkerProcess


def test_a_plain_celery_worker_dead_letters_nothing_at_start(fleet: Fleet) -> None:
    cfg = fleet.config()
    fleet.worker(cfg, hostname="first-demo-lm@test")  # answers the hello of mingle, where mingle runs
    plain = WorkerProcess(model="demo-lm", queue=load_settings(cfg).queue_for("demo-lm"), redis_url=fleet.redis_url,
                          concurrency=8, hostname="plain-demo-lm@test", env={"FLEET_CONFIG": str(cfg)},
                          log_path=fleet.tmp_path / "plain-worker.log")
    plain.cmd = [arg for arg in plain.cmd if arg not in ("--without-gossip", "--without-mingle")]  # the README's
    fleet.workers.append(plain.start())
    plain.wait_ready(120)  # mingle runs before the consumer starts, so before the worker is ready
    log = plain.log_path.read_text() if plain.log_path else ""
    assert "mingle: searching for neighbors" not in log, log[-3000:]
    assert redis.Redis.from_url(fleet.redis_url).llen(DEAD_LETTER_KEY) == 0
    client = fleet.client(cfg)
    assert client.result(client.submit("demo-lm", [5, 6]), wait=True, timeout_s=60) is not None
