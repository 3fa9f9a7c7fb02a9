"""First-day defects of the ``fleet`` CLI, seen through the real command (subprocesses, a private redis-server):

* ``fleet probe ready`` said ``ok`` (exit 0) where no model is configured: run from a folder without
  ``configs/fleet.yaml``, or on a config whose ``models`` is empty; now it fails (exit 1) and says why;
* a Redis URL whose database is not an integer (``…/abc``): ``fleet status`` ran on database 0, ``fleet submit``
  said "unexpected ValueError", ``fleet worker`` died with Celery's traceback; now each refuses the setting (exit
  2, one line);
* a closed stdout (``fleet status | true``): "fleet: unexpected BrokenPipeError", exit 1; now nothing is said and
  the exit is 141, what a shell reports for a command SIGPIPE killed;
* ``fleet worker --logfile F`` (help: "extra args go to celery") failed with "unrecognized arguments"; with
  ``--`` first, Celery received the ``--`` and failed; now both reach Celery, and the options the fleet sets
  itself (``-P``, ``-Q``, …) are refused naming the setting to use.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import yaml

from protocol.keys import WORKER_KEY_PREFIX
from tools.processes import poll_until
from tools.redis_server import EmbeddedRedis

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(240)


def _fleet(*args: str, cwd: Path = ROOT, env: dict[str, str] | None = None,
           stdout_closed: bool = False) -> subprocess.CompletedProcess[str]:
    """``python -m producer.cli <args>`` to completion, without the caller's ``FLEET_*`` variables. With
    ``stdout_closed`` its stdout is a pipe whose reader closes at once (``fleet … | true``)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("FLEET_", "AWS_"))} | (env or {})
    environ["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-m", "producer.cli", *args]
    if not stdout_closed:
        return subprocess.run(cmd, cwd=cwd, env=environ, capture_output=True, text=True, timeout=120, check=False)
    proc = subprocess.Popen(cmd, cwd=cwd, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the command writes anything: it starts in about a second
    err = proc.stderr.read()
    proc.wait(120)
    return subprocess.CompletedProcess(cmd, proc.returncode, "", err)


def _config(tmp_path: Path, redis_url: str, models: dict[str, object]) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump({"redis_url": redis_url, "models": models}))
    return path


def test_a_readiness_probe_with_no_model_configured_fails_saying_why(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    env = {"FLEET_REDIS_URL": redis_server.url}
    no_file = _fleet("probe", "ready", cwd=tmp_path, env=env)  # no configs/fleet.yaml here: no config file read
    assert no_file.returncode == 1 and no_file.stdout == "", (no_file.stdout, no_file.stderr)
    assert no_file.stderr.strip().splitlines() == [
        f"fleet probe ready: FAIL: no models configured (no config file was read: configs/fleet.yaml is not in "
        f"{tmp_path}; run from the folder that holds it, or set FLEET_CONFIG to its path)"]
    empty = _config(tmp_path, redis_server.url, {})
    done = _fleet("probe", "ready", "--config", str(empty), cwd=tmp_path)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stderr.strip() == f"fleet probe ready: FAIL: no models configured: {empty} has none under models"
    live = _fleet("probe", "live", cwd=tmp_path, env=env)  # the process is alive: a restart configures nothing
    assert live.returncode == 0 and live.stdout.strip() == "fleet probe live: ok", (live.stdout, live.stderr)
    assert "note: no models configured (no config file was read" in live.stderr
    status = _fleet("status", cwd=tmp_path, env=env)  # an empty QUEUES table, and why
    assert status.returncode == 0 and "QUEUES" in status.stdout, (status.stdout, status.stderr)
    assert "fleet: note: no models configured (no config file was read" in status.stderr, status.stderr


def test_a_redis_url_whose_database_is_not_an_integer_is_refused_by_every_face(
    tmp_path: Path, redis_server: EmbeddedRedis, model_dir: Path
) -> None:
    """Against a Redis that answers: ``fleet status`` once ran on database 0 there, and said nothing."""
    url = redis_server.url.rsplit("/", 1)[0] + "/abc"
    config = _config(tmp_path, url, {"demo-lm": {"path": str(model_dir / "demo-lm" / "demo-lm-1.0.0.onnx")}})
    for args in (["status"], ["submit", "--model", "demo-lm", "--tokens", "5,6"], ["worker", "--model", "demo-lm"],
                 ["probe", "ready"]):
        done = _fleet(*args, "--config", str(config), cwd=tmp_path)
        assert done.returncode == 2 and "Traceback" not in done.stderr, (args, done.stderr[-2000:])
        assert done.stderr.strip().splitlines() == [
            "fleet: invalid setting redis_url (FLEET_REDIS_URL): database 'abc' is not an integer from 0 to the "
            "server's `databases` - 1 (16 by default): redis://HOST:PORT/DB"], (args, done.stderr)


def test_a_closed_stdout_ends_the_command_quietly_with_141(
    tmp_path: Path, redis_server: EmbeddedRedis, model_dir: Path
) -> None:
    config = _config(tmp_path, redis_server.url,
                     {"demo-lm": {"path": str(model_dir / "demo-lm" / "demo-lm-1.0.0.onnx")}})
    queued = _fleet("submit", "--config", str(config), "--model", "demo-lm", "--tokens", "5,6")
    assert queued.returncode == 0, queued.stderr
    rid = yaml.safe_load(queued.stdout)["request_id"]
    for args in (["status"], ["status", "--json"], ["dead-letter", "list"], ["result", rid]):
        done = _fleet(*args, "--config", str(config), stdout_closed=True)
        assert done.returncode == 141, (args, done.returncode, done.stderr[-2000:])
        said = [line for line in done.stderr.splitlines() if not line.startswith("fleet: warning:")]
        assert said == [], (args, done.stderr)  # no "unexpected BrokenPipeError", no "Exception ignored"


def test_fleet_worker_passes_other_options_to_celery_and_refuses_the_ones_it_sets(
    tmp_path: Path, redis_server: EmbeddedRedis, model_dir: Path
) -> None:
    config = _config(tmp_path, redis_server.url,
                     {"demo-encoder": {"path": str(model_dir / "demo-encoder" / "demo-encoder-1.0.0.onnx")}})
    for given, option, use in ((["-P", "prefork"], "-P", "--concurrency N (worker.concurrency)"),
                               (["--queues=x"], "--queues", "models.<name>.queue"),
                               (["--", "-c", "8"], "-c", "--concurrency N (worker.concurrency)")):
        done = _fleet("worker", "--config", str(config), "--model", "demo-encoder", *given)
        assert done.returncode == 2, (given, done.stderr[-2000:])
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"fleet: fleet worker does not pass {option} to celery: "), lines
        assert use in lines[0], (given, lines)
    log = tmp_path / "celery.log"
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("FLEET_", "AWS_"))}
    worker = subprocess.Popen(  # an option fleet worker does not know, then -- and one more: both reach Celery
        [sys.executable, "-m", "producer.cli", "worker", "--config", str(config), "--model", "demo-encoder", "-c", "8",
         "--logfile", str(log), "-n", "passed@test", "--", "-O", "fair"],
        cwd=ROOT, env=environ, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    client = redis.Redis.from_url(redis_server.url)
    try:
        def beating() -> bool:
            assert worker.poll() is None, worker.stderr.read() if worker.stderr else ""  # it died: say why
            return bool(client.exists(WORKER_KEY_PREFIX + "passed@test"))

        poll_until(beating, 120, "the worker's heartbeat", 0.1)
        celery = Path(f"/proc/{worker.pid}/cmdline").read_text().split("\0")[:-1]  # fleet worker exec'd Celery
        assert celery[1:6] == ["-m", "celery", "-A", "workers.app", "worker"], celery
        assert celery[-4:] == ["--logfile", str(log), "-O", "fair"] and "--" not in celery, celery
        assert log.exists()  # Celery opened the file --logfile names
    finally:
        client.close()
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(30)
        if worker.stderr is not None:
            worker.stderr.close()
