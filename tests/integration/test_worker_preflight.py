"""The commands that hand the process over to a server (``fleet worker``, ``fleet flower``, ``fleet api``) and a
bare ``celery -A workers.app worker`` check the Redis URL first (:mod:`producer.redis_preflight`).

Old behaviour: ``fleet worker`` with a URL that reaches an HTTP port, or ``rediss://`` to a plain Redis, started
Celery, whose consumer retried forever ("consumer: Cannot connect to rediss://…: … wrong version number. Trying
again in 16.00 seconds"), and a SIGTERM did not stop the one stuck in a TLS handshake; ``fleet flower`` and
``fleet api`` started on it too. And ``rediss://`` to an HTTP port said "cannot reach Redis … start one with
`fleet redis`", where something answered. Now each exits 2 with the one line the other commands print. A Redis
that does not answer at all only warns: the worker starts and serves once Redis comes up.

Real processes: a real redis-server, a real HTTP server, the real CLI and Celery worker in subprocesses.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import redis

from protocol.keys import WORKER_KEY_PREFIX
from tests.integration.ops_fixtures import ROOT, OpsFleet, ops_fleet, ops_models, ops_redis, wait_until  # noqa: F401
from tests.integration.test_first_day import http_port  # noqa: F401
from tests.integration.test_unhappy_paths import fleet, one_line, together
from tools.redis_server import EmbeddedRedis, free_port

pytestmark = pytest.mark.timeout(240)

NOT_REDIS = "is not Redis"
NO_TLS_PLAIN_REDIS = ("does not speak TLS", "a plain Redis answers", "redis:// instead of rediss://")
NO_TLS_NOT_REDIS = ("did not speak TLS and is not Redis", "a plain PING got", "check the host and port")


def _urls(ops: OpsFleet, http: int) -> dict[str, Path]:
    """Configs whose Redis URL reaches an HTTP server, a plain Redis as ``rediss://``, an HTTP server as
    ``rediss://``."""
    flower = {"basic_auth": ["admin:choose-a-password"]}
    return {
        "http": ops.config(redis_url=f"redis://127.0.0.1:{http}/0", flower=flower),
        "tls-to-plain": ops.config(redis_url=f"rediss://127.0.0.1:{ops.server.port}/0", flower=flower),
        "tls-to-http": ops.config(redis_url=f"rediss://127.0.0.1:{http}/0", flower=flower),
    }


def _check(done: subprocess.CompletedProcess[str], case: str, http: int) -> None:
    if case == "http":
        line = one_line(done, 2, f"what answers at 127.0.0.1:{http} {NOT_REDIS}", "FLEET_REDIS_URL")
    elif case == "tls-to-plain":
        line = one_line(done, 2, *NO_TLS_PLAIN_REDIS)
    else:
        line = one_line(done, 2, f"what answers at 127.0.0.1:{http}", *NO_TLS_NOT_REDIS)
    assert "fleet redis" not in line and "unexpected" not in line, line


def test_fleet_worker_refuses_a_url_that_reaches_no_redis(ops_fleet: OpsFleet, http_port: int) -> None:  # noqa: F811
    configs = _urls(ops_fleet, http_port)
    runs = together(*(partial(fleet, "worker", config=path) for path in configs.values()))
    for case, done in zip(configs, runs, strict=True):
        _check(done, case, http_port)
        assert "celery@" not in done.stdout + done.stderr  # Celery never started
    assert ops_fleet.redis.keys("fleet:worker:*") == []


def test_every_command_on_such_a_url_says_the_same(ops_fleet: OpsFleet, http_port: int) -> None:  # noqa: F811
    """The siblings: the servers (api, flower) and the one-shot commands (status, submit, result, cancel,
    dead-letter), on the URL ``rediss://`` to an HTTP port, whose line was "cannot reach Redis"."""
    configs = _urls(ops_fleet, http_port)
    commands = {
        "api": ("api", "--port", str(free_port())),
        "flower": ("flower", "--port", str(free_port()), "--db", str(ops_fleet.tmp_path / "flower.db")),
        "status": ("status",),
        "submit": ("submit", "--model", "demo-lm", "--tokens", "5,6,7"),
        "result": ("result", "no-such-id"),
        "cancel": ("cancel", "no-such-id"),
        "dead-letter": ("dead-letter", "list"),
    }
    cases = [(name, case) for name in commands for case in configs]
    runs = together(*(partial(fleet, *commands[name], config=configs[case]) for name, case in cases))
    for (name, case), done in zip(cases, runs, strict=True):
        try:
            _check(done, case, http_port)
        except AssertionError as exc:
            raise AssertionError(f"fleet {name} on {case}: {exc}") from exc
    assert ops_fleet.redis.llen("fleet.demo-lm") == 0


def test_a_bare_celery_worker_refuses_it_too(ops_fleet: OpsFleet, http_port: int) -> None:  # noqa: F811
    config = _urls(ops_fleet, http_port)["tls-to-http"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLEET_", "AWS_"))}
    done = subprocess.run([sys.executable, "-m", "celery", "-A", "workers.app", "worker", "-P", "threads", "-c", "8",
                           "-Q", "fleet.demo-lm", "--without-gossip", "--without-mingle"], cwd=ROOT,
                          env=env | {"FLEET_CONFIG": str(config)}, capture_output=True, text=True, timeout=90,
                          check=False)
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    assert "Traceback" not in done.stderr and "Trying again" not in done.stderr, done.stderr[-3000:]
    lines = [x for x in done.stderr.splitlines() if x.startswith("fleet: ")]
    assert len(lines) == 1 and all(text in lines[0] for text in NO_TLS_NOT_REDIS), done.stderr[-3000:]


def test_a_redis_that_is_not_up_yet_only_warns(ops_fleet: OpsFleet) -> None:  # noqa: F811
    """Nothing answers at the URL: ``fleet worker`` says so and starts; once a Redis listens there the worker
    is ready and serves (a compose file or a pod that starts the worker before Redis)."""
    port = free_port()
    config = ops_fleet.config(redis_url=f"redis://127.0.0.1:{port}/0")
    worker = ops_fleet.spawn([sys.executable, "-m", "producer.cli", "worker", "--config", str(config),
                              "-n", "late-redis@test"], name="late-worker")
    log = ops_fleet.tmp_path / f"late-worker-{ops_fleet._n}.log"
    wait_until(lambda: "fleet worker: warning: cannot reach Redis" in log.read_text(), 60, "the preflight warning")
    assert worker.poll() is None, log.read_text()[-3000:]
    with EmbeddedRedis(port) as late:
        client = redis.Redis.from_url(late.url)
        try:
            wait_until(lambda: client.exists(f"{WORKER_KEY_PREFIX}late-redis@test"), 90, "the worker's heartbeat")
        finally:
            client.close()
        assert worker.poll() is None, log.read_text()[-3000:]
        os.killpg(worker.pid, signal.SIGTERM)  # while its Redis is up: a clean stop
        worker.wait(30)


def test_a_tls_redis_whose_certificate_is_not_trusted(ops_fleet: OpsFleet, tmp_path: Path) -> None:  # noqa: F811
    """A real TLS Redis, reached without its CA: the peer speaks TLS, so no "did not speak TLS" and no "cannot
    reach" (it answered): the line names the TLS settings, exit 2, and the worker does not start to retry it."""
    from tests.integration.test_redis_security import make_pki

    tls = make_pki(tmp_path)  # EmbeddedRedis(tls=...) finds a redis-server built with TLS (.ci/run installs one)
    with EmbeddedRedis(tls=tls) as server:
        config = ops_fleet.config(redis_url=f"rediss://127.0.0.1:{server.port}/0")  # no CA: not verified
        worker, status = together(partial(fleet, "worker", config=config), partial(fleet, "status", config=config))
    for done in (worker, status):
        line = one_line(done, 2, f"TLS to Redis at rediss://127.0.0.1:{server.port}/0 failed",
                        "certificate verify failed", "FLEET_REDIS__TLS_")
        assert "did not speak TLS" not in line and "fleet redis" not in line, line
