"""A new user's first-day mistakes that the CLI once answered badly: each now gets one ``fleet:`` line naming the
variable, flag or address and the fix, a sensible exit code, no traceback, and loses nothing.

* a list setting written in the environment as a bare word or with Python's quotes
  (``FLEET_API__API_KEYS=change-me``): was ``unexpected SettingsError: error parsing value for field "api"``,
  exit 1 (and a traceback from a bare ``celery -A workers.app worker``);
* ``--tokens "5 6 7"``: the spaces were dropped and the one id 567 was sent (``1 2 3`` queued id 123 silently);
* ``fleet flower`` on a taken port: Tornado's traceback;
* a Redis URL that reaches something else than Redis (an HTTP port): ``unexpected InvalidResponse``; and
  ``rediss://`` to a plain Redis: ``Timeout connecting to server; start one with `fleet redis``` for a server
  that answers;
* ``fleet api --host 0.0.0.0`` with no API key: the same quiet log line as on loopback;
* Ctrl-C while the CLI starts (its commands' modules load for about a second): a traceback.

Also covered here because nothing else ran it: Ctrl-C while ``fleet result --wait`` waits (exit 130, the request
stays queued). Real ``fleet`` subprocesses, real redis-server, real gateway; the CLI's other unhappy paths are in
test_unhappy_paths.py.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from functools import partial
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from tests.integration.ops_fixtures import OpsFleet, ops_fleet, ops_models, ops_redis  # noqa: F401
from tests.integration.test_unhappy_paths import fleet, one_line, together
from tools.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(180)


def _clean_env(**extra: str) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("FLEET_", "AWS_"))} | extra


def test_a_json_setting_written_wrong_in_the_environment(tmp_path: Path) -> None:
    config = tmp_path / "fleet.yaml"
    config.write_text("redis_url: redis://127.0.0.1:1/0\n")  # never reached: the settings stop first
    cases = {
        "FLEET_API__API_KEYS": ("change-me-secret", "this setting is a list"),
        "FLEET_FLOWER__BASIC_AUTH": ("['admin:pw-secret']", "this setting is a list"),  # Python's quotes
        "FLEET_MODELS__DEMO_LM__ENGINE__PROVIDERS": ("CPUExecutionProvider", "this setting is a list"),
        "FLEET_MODELS__DEMO_LM__BATCHING": ('{"max_batch_size": 4', "this setting is a section"),
    }
    runs = together(*(partial(fleet, "status", config=config, env={var: value}) for var, (value, _) in cases.items()))
    for (var, (value, says)), done in zip(cases.items(), runs, strict=True):
        line = one_line(done, 2, f"environment variable {var} is not valid JSON", says, f"{var}='")
        assert value not in done.stdout + done.stderr, line  # the value may be a key or a password: never shown
    assert '["a", "b"]' in one_line(runs[0], 2)

    # a bare Celery worker (README: `celery -A workers.app worker` works directly) says the same, exit 2
    worker = subprocess.run([sys.executable, "-m", "celery", "-A", "workers.app", "worker", "-P", "threads"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
                            env=_clean_env(FLEET_CONFIG=str(config), FLEET_API__API_KEYS="change-me-secret"))
    assert worker.returncode == 2, worker.stderr[-3000:]
    assert "Traceback" not in worker.stderr and "change-me-secret" not in worker.stderr, worker.stderr[-3000:]
    assert "fleet: environment variable FLEET_API__API_KEYS is not valid JSON" in worker.stderr, worker.stderr


def _queued_ids(ops: OpsFleet, request_id: str) -> list[int]:
    """The ``input_ids`` of the request ``request_id`` as queued on ``fleet.demo-lm`` (the Celery body's args)."""
    for raw in ops.redis.lrange("fleet.demo-lm", 0, -1):
        message = json.loads(raw)
        args = json.loads(base64.b64decode(message["body"]))[0]
        if args[0].get("request_id") == request_id:
            return list(args[0]["input_ids"])
    raise AssertionError(f"{request_id} is not queued")


def test_token_ids_separated_by_spaces(ops_fleet: OpsFleet) -> None:  # noqa: F811
    config = ops_fleet.config()
    spaced, mixed, bracketed = together(
        partial(fleet, "submit", "--model", "demo-lm", "--tokens", "1 2 3", "--request-id", "sp-1", config=config),
        partial(fleet, "submit", "--model", "demo-lm", "--tokens", "5, 6 ,7", "--request-id", "sp-2", config=config),
        partial(fleet, "submit", "--model", "demo-lm", "--tokens", "[5,6,7]", config=config))
    assert spaced.returncode == 0 and mixed.returncode == 0, spaced.stderr + mixed.stderr
    assert _queued_ids(ops_fleet, "sp-1") == [1, 2, 3]  # was [123]
    assert _queued_ids(ops_fleet, "sp-2") == [5, 6, 7]
    one_line(bracketed, 2, "--tokens must be comma-separated integers", "'[5'")
    assert ops_fleet.redis.llen("fleet.demo-lm") == 2  # the refused one queued nothing


def test_flower_on_a_taken_port_or_a_foreign_address(ops_fleet: OpsFleet) -> None:  # noqa: F811
    config = ops_fleet.config(flower={"basic_auth": ["admin:choose-a-password"]})
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        on_taken, foreign = together(
            partial(fleet, "flower", "--port", str(taken), "--db", str(ops_fleet.tmp_path / "f.db"), config=config),
            partial(fleet, "flower", "--host", "192.0.2.1", "--port", str(free_port()), config=config))
    one_line(on_taken, 1, f"cannot listen on 127.0.0.1:{taken}", "already in use", "--port", "FLEET_FLOWER__PORT")
    one_line(foreign, 1, "cannot listen on 192.0.2.1:", "--host", "0.0.0.0")


class _NotRedis(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(404)
        self.end_headers()

    def log_message(self, *_: object) -> None:
        return


@pytest.fixture
def http_port() -> Iterator[int]:
    """A real HTTP server on a loopback port: what a Redis URL with the gateway's or Flower's port reaches."""
    server = HTTPServer(("127.0.0.1", 0), _NotRedis)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_a_redis_url_that_reaches_no_redis_or_asks_for_tls(ops_fleet: OpsFleet, http_port: int) -> None:  # noqa: F811
    http = ops_fleet.config(redis_url=f"redis://127.0.0.1:{http_port}/0")
    tls = ops_fleet.config(redis_url=f"rediss://127.0.0.1:{ops_fleet.server.port}/0")
    submit = ("submit", "--model", "demo-lm", "--tokens", "5,6,7")
    runs = together(partial(fleet, "status", config=http), partial(fleet, *submit, config=http),
                    partial(fleet, "status", config=tls), partial(fleet, *submit, config=tls))
    for done in runs[:2]:
        line = one_line(done, 2, f"what answers at 127.0.0.1:{http_port} is not Redis", "FLEET_REDIS_URL")
        assert "fleet redis" not in line and "unexpected" not in line
    for done in runs[2:]:
        line = one_line(done, 2, "does not speak TLS", "a plain Redis answers", "redis:// instead of rediss://")
        assert "fleet redis" not in line
    assert ops_fleet.redis.llen("fleet.demo-lm") == 0


def _gateway_start_lines(config: Path, host: str) -> tuple[list[str], subprocess.Popen[str]]:
    """``fleet api --host host`` started: its stderr lines up to uvicorn's "Uvicorn running" (and the process)."""
    proc = subprocess.Popen([sys.executable, "-m", "producer.cli", "api", "--config", str(config), "--host", host,
                             "--port", str(free_port()), "--no-access-log"], cwd=ROOT, env=_clean_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    lines = []
    for line in proc.stderr:  # ends at the process's end: a gateway that does not start fails below
        lines.append(line.rstrip())
        if "Uvicorn running on" in line:
            break
    return lines, proc


def test_a_gateway_beyond_loopback_without_api_keys_warns_loudly(ops_fleet: OpsFleet) -> None:  # noqa: F811
    config = ops_fleet.config(api={"api_keys": []})
    started = []
    try:
        for host in ("0.0.0.0", "127.0.0.1"):
            started.append(_gateway_start_lines(config, host))
    finally:
        for _, proc in started:
            proc.terminate()
            proc.wait(15)
    (exposed, _), (loopback, _) = started
    assert any("Uvicorn running on" in x for x in exposed + loopback), exposed + loopback
    loud = [x for x in exposed if x.startswith("fleet: WARNING:")]
    assert len(loud) == 1 and "NO API KEY" in loud[0] and "FLEET_API__API_KEYS" in loud[0], exposed
    assert "0.0.0.0:" in loud[0] and "127.0.0.1" in loud[0]  # where it listens, and the way to keep it local
    assert not [x for x in loopback if x.startswith("fleet: WARNING:")], loopback  # only this machine reaches it


def _ctrl_c_as_a_terminal() -> None:
    """In the child before it runs: SIGINT as a terminal's shell leaves it (its default action). A test run
    started in the background by a non-interactive shell (``make test &``, ``nohup``) inherits SIGINT ignored,
    and Python then keeps ignoring it: the Ctrl-C these tests send would never arrive."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


INTERRUPT_AT_START = """
import os, signal, sys
import producer.cli as cli
register = cli._register_extensions
def interrupted(sub):  # Ctrl-C lands while the commands' modules load
    os.kill(os.getpid(), signal.SIGINT)
    register(sub)
cli._register_extensions = interrupted
raise SystemExit(cli.main(sys.argv[1:]))
"""


def test_ctrl_c_while_the_cli_starts(tmp_path: Path) -> None:
    """A real SIGINT, sent by the process to itself at the point of start-up where the parser loads the commands'
    modules (a second or so in which a user's Ctrl-C lands): exit 130 and one line, as everywhere else."""
    done = subprocess.run([sys.executable, "-c", INTERRUPT_AT_START, "status"], cwd=ROOT, env=_clean_env(),
                          capture_output=True, text=True, timeout=60, check=False, preexec_fn=_ctrl_c_as_a_terminal)
    one_line(done, 130, "fleet: interrupted")


def test_ctrl_c_while_waiting_for_a_result(ops_fleet: OpsFleet) -> None:  # noqa: F811
    config = ops_fleet.config()  # no worker: the request waits in its queue
    queued = fleet("submit", "--model", "demo-lm", "--tokens", "5,6,7", "--request-id", "wait-int", config=config)
    assert queued.returncode == 0, queued.stderr
    proc = subprocess.Popen([sys.executable, "-m", "producer.cli", "result", "wait-int", "--wait", "--timeout", "600",
                             "--config", str(config)], cwd=ROOT, env=_clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_ctrl_c_as_a_terminal)
    assert proc.stderr is not None
    first = proc.stderr.readline()  # said (flushed) right before the wait begins
    assert first.startswith("fleet: warning: no live worker serves model 'demo-lm'"), first
    proc.send_signal(signal.SIGINT)
    out, rest = proc.communicate(timeout=60)
    assert proc.returncode == 130, (proc.returncode, out, rest)
    assert rest.strip() == "fleet: interrupted" and not out.strip(), (out, rest)
    after = fleet("result", "wait-int", config=config)  # nothing lost: still queued, still known
    assert after.returncode == 0 and '"status": "queued"' in after.stdout, after.stdout + after.stderr
    assert ops_fleet.redis.llen("fleet.demo-lm") == 1


def test_text_for_a_model_whose_file_is_not_on_this_machine(ops_fleet: OpsFleet) -> None:  # noqa: F811
    """Before: "model 'demo-lm' has no tokenizer on this machine: send input_ids", which hid the cause (the
    configured path does not exist here and no worker has published the model's card)."""
    config = ops_fleet.config(models={"demo-lm": {"path": "/nonexistent/demo-lm-1.0.0.onnx"}})
    done = fleet("submit", "--model", "demo-lm", "--text", "hello", config=config)
    one_line(done, 2, "model 'demo-lm' has no card here: its path does not exist on this machine",
             "fleet build-model", "--tokens")
    assert ops_fleet.redis.llen("fleet.demo-lm") == 0  # nothing queued
