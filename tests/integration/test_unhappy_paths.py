"""The first day off the happy path: each failure a new user meets gives one line on stderr that names
the cause and the fix, the documented exit code, and no traceback unless ``fleet --debug``.

Every case runs the real ``fleet`` CLI as a subprocess against real processes (redis-server, a
password-protected one, the demo models); the README's troubleshooting table lists the same cases.
The gateway's missing ``Content-Type`` case is tested with the gateway (test_body_amplification.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import pytest

from protocol.keys import CANCEL_KEY
from tests.integration.ops_fixtures import OpsFleet, ops_fleet, ops_models, ops_redis  # noqa: F401
from tools.redis_server import EmbeddedRedis, free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(240)


def fleet(*args: str, config: Path | None = None, env: dict[str, str] | None = None, debug: bool = False,
          prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """``fleet [--debug] <args> [--config C]`` to completion (60 s at most: nothing here may wait longer)."""
    cmd = [*prefix, sys.executable, "-m", "producer.cli", *(["--debug"] if debug else []), *args]
    if config is not None:
        cmd += ["--config", str(config)]
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("FLEET_", "AWS_"))} | (env or {})
    return subprocess.run(cmd, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=60, check=False)


def together(*runs: Callable[[], subprocess.CompletedProcess[str]]) -> list[subprocess.CompletedProcess[str]]:
    """Independent ``fleet`` runs (``partial(fleet, ...)``: none depends on what another did) at once, in order:
    each is still its own process with its own checks, the test just does not wait for them one by one."""
    with ThreadPoolExecutor(len(runs)) as pool:
        return list(pool.map(lambda run: run(), runs))


def one_line(done: subprocess.CompletedProcess[str], code: int, *says: str) -> str:
    """The run exited ``code`` with exactly one ``fleet:`` error line (besides warnings) holding ``says``."""
    assert done.returncode == code, (done.returncode, done.stdout[-1500:], done.stderr[-3000:])
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = [x for x in done.stderr.splitlines() if x.strip() and not x.startswith("fleet: warning:")]
    assert len(lines) == 1 and lines[0].startswith("fleet: "), done.stderr[-3000:]
    for text in says:
        assert text in lines[0], (text, lines[0])
    return lines[0]


def traceback_with_debug(done: subprocess.CompletedProcess[str], code: int = 1) -> None:
    """``--debug`` shows where it failed."""
    assert done.returncode == code, (done.returncode, done.stderr[-2000:])
    assert "Traceback (most recent call last)" in done.stderr, done.stderr[-2000:]


def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "fleet.yaml"
    bad.write_text("redis_url: redis://127.0.0.1:6379/0\nworker\n  model: [demo-lm\n")
    plain, debug = together(partial(fleet, "status", config=bad), partial(fleet, "status", config=bad, debug=True))
    line = one_line(plain, 2, str(bad), "invalid YAML", "fix the file")
    assert ":3:" in line  # the line of the error
    traceback_with_debug(debug)


def test_redis_down(ops_fleet: OpsFleet) -> None:  # noqa: F811
    config = ops_fleet.config(redis_url=f"redis://127.0.0.1:{free_port()}/0")
    *runs, debug = together(partial(fleet, "status", config=config),
                            partial(fleet, "submit", "--model", "demo-lm", "--tokens", "5,6,7", config=config),
                            partial(fleet, "status", config=config, debug=True))
    for done in runs:
        one_line(done, 1, "cannot reach Redis", "fleet redis", "FLEET_REDIS_URL")
    traceback_with_debug(debug)


def test_a_database_the_server_does_not_have(ops_fleet: OpsFleet) -> None:  # noqa: F811
    """Redis answers, so "cannot reach Redis … start one with fleet redis" was the wrong fix: the URL's database
    number is a setting (exit 2)."""
    config = ops_fleet.config(redis_url=ops_fleet.redis_url.rsplit("/", 1)[0] + "/99")
    for done in together(partial(fleet, "status", config=config),
                         partial(fleet, "submit", "--model", "demo-lm", "--tokens", "5,6,7", config=config)):
        line = one_line(done, 2, "has no such database", "FLEET_REDIS_URL")
        assert "fleet redis" not in line


def test_a_wrong_password(ops_fleet: OpsFleet) -> None:  # noqa: F811
    with EmbeddedRedis(password="the-right-one") as server:
        config = ops_fleet.config(redis_url=f"redis://:not-the-password@127.0.0.1:{server.port}/0")
        *runs, debug = together(partial(fleet, "status", config=config),
                                partial(fleet, "submit", "--model", "demo-lm", "--tokens", "5,6,7", config=config),
                                partial(fleet, "status", config=config, debug=True))
        for done in runs:
            one_line(done, 1, "refused the credentials", "FLEET_REDIS_URL", ":***@")
            assert "not-the-password" not in done.stdout + done.stderr
        traceback_with_debug(debug)
        config = ops_fleet.config(redis_url=f"redis://127.0.0.1:{server.port}/0")  # none at all
        for done in together(partial(fleet, "status", config=config),
                             partial(fleet, "submit", "--model", "demo-lm", "--tokens", "5,6,7", config=config)):
            # was "refused the credentials: HELLO must be called with the client already authenticated": none given
            one_line(done, 1, "requires a password and FLEET_REDIS_URL gives none", "redis://USER:PASSWORD@")


def test_an_unknown_model(ops_fleet: OpsFleet) -> None:  # noqa: F811
    config = ops_fleet.config()
    done, debug = together(partial(fleet, "submit", "--model", "no-such-model", "--tokens", "5,6,7", config=config),
                           partial(fleet, "submit", "--model", "no-such-model", "--tokens", "5", config=config,
                                   debug=True))
    one_line(done, 2, "unknown model 'no-such-model'", "configured models: demo-encoder, demo-lm")
    traceback_with_debug(debug)


def test_a_model_with_no_worker_is_accepted_and_said(ops_fleet: OpsFleet) -> None:  # noqa: F811
    config = ops_fleet.config()
    ops_fleet.worker(config, "demo-lm")  # a live worker, but of another model
    queued = fleet("submit", "--model", "demo-encoder", "--text", "hello", "--request-id", "nw-1", config=config)
    assert queued.returncode == 0, queued.stderr
    assert '"warning": "no live worker serves model \'demo-encoder\'' in queued.stdout, queued.stdout
    assert "fleet worker --model demo-encoder" in queued.stderr
    status = fleet("result", "nw-1", config=config)
    assert '"status": "queued"' in status.stdout and "no live worker serves model 'demo-encoder'" in status.stdout
    waited = fleet("submit", "--model", "demo-encoder", "--text", "hello", "--wait", "--timeout", "1", config=config)
    one_line(waited, 1, "no result", "no live worker serves model 'demo-encoder'", "fleet worker --model demo-encoder")
    assert waited.stderr.startswith("fleet: warning: no live worker")  # said at once, not only after the wait
    served = fleet("submit", "--model", "demo-lm", "--tokens", "5,6,7", config=config)
    assert served.returncode == 0 and "warning" not in served.stdout + served.stderr, served.stdout + served.stderr
    generated = fleet("submit", "--model", "demo-lm", "--text", "Hi", "--max-new-tokens", "2", "--wait", config=config)
    assert generated.returncode == 0, generated.stderr  # the demo LM's text is said to be noise before it is printed
    assert "fleet: note: demo-lm has random weights" in generated.stderr, generated.stderr
    traceback_with_debug(fleet("submit", "--model", "demo-encoder", "--text", "x", "--wait", "--timeout", "1",
                               config=config, debug=True))
    one_line(fleet("submit", "--model", "demo-encoder", "--text", "x", "--top-k", "3", config=config), 2,
             "output.top_k", "'embedding'", "leave top_k out")  # before: queued, and --top-k silently ignored
    ended = fleet("submit", "--model", "demo-lm", "--tokens", "5,6,7", "--request-id", "nw-done", "--wait",
                  config=config)
    assert ended.returncode == 0, ended.stderr
    # too late to cancel: exit 1 and a line saying why (before: exit 1 and nothing on stderr)
    one_line(fleet("cancel", "nw-done", config=config), 1, "'nw-done' was not cancelled", "already ended (succeeded)")
    cancelled = fleet("cancel", "nw-1", config=config)  # still queued: cancelled, exit 0, nothing on stderr
    assert cancelled.returncode == 0 and '"cancelled": true' in cancelled.stdout, cancelled.stdout + cancelled.stderr
    assert not cancelled.stderr.strip(), cancelled.stderr
    again = fleet("submit", "--model", "demo-encoder", "--text", "hello", "--request-id", "nw-1", config=config)
    assert again.returncode == 0 and '"status": "cancelled"' in again.stdout, again.stdout  # the same request:
    assert "warning" not in again.stdout + again.stderr, again.stdout + again.stderr  # it ended, nothing awaited
    # cancelled while queued by a cancel mark alone (what the gateway writes when an OpenAI call finds no worker),
    # no worker to store why: over at once, as a stored cancel is (exit 1); --timeout 600 with a 60 s cap on the
    # run fails with TimeoutExpired if it is waited out (it was; and without --wait it exited 0)
    marked = fleet("submit", "--model", "demo-encoder", "--text", "hi", "--request-id", "nw-marked", config=config)
    assert marked.returncode == 0, marked.stderr
    ops_fleet.redis.set(CANCEL_KEY.format(id="nw-marked"), "1")
    for wait in ((), ("--wait", "--timeout", "600")):
        one_line(fleet("result", "nw-marked", *wait, config=config), 1, "nw-marked was cancelled before it ran")


def test_an_unknown_request_id_does_not_wait_out_the_timeout(ops_fleet: OpsFleet) -> None:  # noqa: F811
    config = ops_fleet.config()
    # --timeout 600 with a 60 s cap on the run: waiting it out fails the test with TimeoutExpired
    done, cancel, debug = together(
        partial(fleet, "result", "no-such-id", "--wait", "--timeout", "600", config=config),
        partial(fleet, "cancel", "no-such-id", config=config),
        partial(fleet, "result", "no-such-id", "--wait", "--timeout", "600", config=config, debug=True))
    one_line(done, 1, "no request 'no-such-id' is known", "check the ID")
    one_line(cancel, 1, "no request 'no-such-id' is known")
    assert not ops_fleet.redis.exists("fleet:cancel:no-such-id")  # nothing marked for an ID nobody sent
    traceback_with_debug(debug)


@pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux unshare is missing")
def test_the_loopback_down(ops_fleet: OpsFleet) -> None:  # noqa: F811
    netns = ("unshare", "--user", "--map-root-user", "--net") if os.geteuid() else ("unshare", "--net")
    probe = subprocess.run([*netns, "true"], capture_output=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a network namespace here: {probe.stderr.decode()[-300:]}")
    # each run in a network namespace of its own; the demo is what `make demo` runs, on models already built
    redis_run, demo, debug = together(
        partial(fleet, "redis", "--port", "0", prefix=netns),
        partial(fleet, "demo", "--no-flower", "--requests", "1", config=ops_fleet.config(), prefix=netns),
        partial(fleet, "redis", "--port", "0", prefix=netns, debug=True))
    one_line(redis_run, 1, "loopback interface is down", "ip link set lo up")
    one_line(demo, 1, "loopback interface is down", "ip link set lo up")
    traceback_with_debug(debug)


def test_a_taken_port(ops_fleet: OpsFleet) -> None:  # noqa: F811
    taken = ops_fleet.server.port
    redis_run, api, debug = together(partial(fleet, "redis", "--port", str(taken)),
                                     partial(fleet, "api", "--port", str(taken), config=ops_fleet.config()),
                                     partial(fleet, "redis", "--port", str(taken), debug=True))
    one_line(redis_run, 1, f"port {taken}", "already in use", "--port")
    one_line(api, 1, f"127.0.0.1:{taken}", "already in use", "--port")
    traceback_with_debug(debug)


def test_a_missing_store(ops_fleet: OpsFleet, tmp_path: Path) -> None:  # noqa: F811
    config = ops_fleet.config()
    down = {"FLEET_STORE__BACKEND": "s3", "FLEET_STORE__ENDPOINT_URL": f"http://127.0.0.1:{free_port()}",
            "FLEET_STORE__BUCKET": "fleet-models", "AWS_ACCESS_KEY_ID": "fleet", "AWS_SECRET_ACCESS_KEY": "secret-1"}
    none, unreachable, debug = together(partial(fleet, "models", "list", config=config),
                                        partial(fleet, "models", "list", config=config, env=down),
                                        partial(fleet, "models", "list", config=config, env=down, debug=True))
    one_line(none, 2, "no model store is configured", "FLEET_STORE__BACKEND")
    one_line(unreachable, 1, "Could not connect", "fleet store", "FLEET_STORE__ENDPOINT_URL")
    traceback_with_debug(debug)
