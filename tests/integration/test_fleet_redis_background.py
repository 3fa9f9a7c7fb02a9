"""`fleet redis --background` and the README's Redis lines on a machine where the port is taken.

The README's "Running a fleet by hand" must not leave a reader attached to a Redis it did not start:
on a machine where the port is taken (here: a private redis-server of this test plays the foreign one;
the machine's own 6379 is never touched), the lines the README gives are run as written, with 6379
mapped to the taken port, and the next `fleet` command must refuse rather than talk to the foreign
Redis. Real CLI subprocesses, real redis-servers.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tools.redis_server import EmbeddedRedis

ROOT = Path(__file__).resolve().parents[2]
STOP_DEADLINE_S = 15.0
_PROCESS = re.compile(r"process (\d+)")


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}


def _readme_redis_lines() -> list[str]:
    """The lines of the "Running a fleet by hand" block that start Redis or set FLEET_REDIS_URL."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Running a fleet by hand\n", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if "fleet redis" in line or "FLEET_REDIS_URL" in line]


def _on_port(line: str, port: int) -> str:
    """``line`` as it runs on a machine whose Redis port is ``port``: 6379 and --port N become ``port``."""
    line = line.replace("6379", str(port))
    line = re.sub(r"--port \d+", f"--port {port}", line)
    return re.sub(r"(fleet redis)(?! [^#]*--port)", rf"\1 --port {port}", line)


def _connections(client: redis.Redis[bytes]) -> int:
    """Connections the server has accepted so far (``client``'s own, open all along, counts once)."""
    return int(client.info("stats")["total_connections_received"])


@pytest.fixture
def stop_backgrounds() -> Iterator[list[int]]:
    """Pids of background ``fleet redis`` processes a test started; each is stopped (SIGTERM) afterwards."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


def _background_pid(stderr: str) -> int:
    found = _PROCESS.search(stderr)
    assert found, stderr
    return int(found[1])


def test_background_prints_only_the_url_of_its_own_server_and_kill_stops_it(stop_backgrounds: list[int]) -> None:
    proc = subprocess.run([sys.executable, "-m", "producer.cli", "redis", "--port", "0", "--background"],
                          capture_output=True, text=True, timeout=60, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    pid = _background_pid(proc.stderr)
    stop_backgrounds.append(pid)
    url = proc.stdout.strip()
    assert proc.stdout == f"{url}\n" and re.fullmatch(r"redis://127\.0\.0\.1:\d+/0", url), proc.stdout
    assert f"kill {pid}" in proc.stderr
    client = redis.Redis.from_url(url, socket_timeout=5)
    server_pid = int(client.info("server")["process_id"])
    assert int(Path(f"/proc/{server_pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid  # its child
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_DEADLINE_S
    while True:  # the server goes with it
        try:
            client.ping()
        except redis.ConnectionError:
            break
        assert time.monotonic() < deadline, "the background redis-server outlived `kill PID`"
        time.sleep(0.05)


def test_background_on_a_taken_port_prints_nothing_and_names_the_port(redis_server: EmbeddedRedis) -> None:
    proc = subprocess.run([sys.executable, "-m", "producer.cli", "redis", "--port", str(redis_server.port),
                           "--background"], capture_output=True, text=True, timeout=60, env=_env(), cwd=ROOT)
    assert (proc.returncode, proc.stdout) == (1, "")
    assert f"port {redis_server.port} on 127.0.0.1 is already in use" in proc.stderr


def test_the_readmes_redis_lines_never_reach_a_redis_that_holds_the_port(redis_server: EmbeddedRedis) -> None:
    """Old README: `fleet redis &` failed in the background, then `export FLEET_REDIS_URL=…6379` pointed
    every later command at the foreign Redis."""
    lines = [_on_port(line, redis_server.port) for line in _readme_redis_lines()]
    assert lines, "the README's Running a fleet by hand starts no Redis"
    foreign = redis_server.client()
    before = _connections(foreign)
    script = "\n".join([*lines, "echo \"url=[$FLEET_REDIS_URL]\"", ".venv/bin/fleet status"])
    proc = subprocess.Popen(["bash", "-c", script], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=120)
    finally:  # a background job the lines started (`fleet redis &`) goes with the session
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    assert _connections(foreign) == before, f"the README's lines reached the foreign Redis:\n{lines}\n{out}"
    assert "url=[]" in out and proc.returncode == 2, out + err
    assert "invalid setting redis_url (FLEET_REDIS_URL)" in err
    assert f"port {redis_server.port} on 127.0.0.1 is already in use" in err
