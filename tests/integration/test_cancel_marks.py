"""``broker.cancel_marks``: the cancel mark is read in the pipeline that takes a message (real worker,
real redis-server, Redis's own MONITOR), and a request cancelled while queued is not run."""

from __future__ import annotations

import re
import threading
from typing import Any

import pytest
import redis

from broker.cancel_marks import CancelMarks
from protocol.errors import RequestCancelled
from tests.integration.fleet_fixtures import Fleet

_LINE = re.compile(r"\[(\d+) (.*?)\] (.*)")
_ARGUMENT = re.compile(r'"((?:[^"\\]|\\.)*)"')
"""One quoted argument of a MONITOR line, escapes included: redis-py's own parser (``"(.*?)(?<!\\)"``) ends an
argument that ends in an escaped backslash only at a later quote, and so mangles the line."""


def parse_monitor_line(line: str) -> dict[str, Any]:
    """One line of Redis's MONITOR output as redis-py's ``Monitor`` reports it (``time``, ``db``,
    ``client_address``, ``client_port``, ``client_type``: tcp, unix or lua; ``command``: the arguments joined by
    spaces, ``\\"`` and ``\\\\`` unescaped, other escapes such as ``\\x06`` kept as Redis wrote them)."""
    stamp, rest = line.split(" ", 1)
    match = _LINE.match(rest)
    if match is None:
        return {"time": float(stamp), "db": -1, "client_address": "", "client_port": "", "client_type": "",
                "command": rest}
    db, client, quoted = match.groups()
    if client == "lua":
        address, port, kind = "lua", "", "lua"
    elif client.startswith("unix"):
        address, port, kind = "unix", client[5:], "unix"
    else:
        address, _, port = client.rpartition(":")
        kind = "tcp"
    args = [re.sub(r'\\([\\"])', r"\1", a) for a in _ARGUMENT.findall(quoted)]
    return {"time": float(stamp), "db": int(db), "client_address": address, "client_port": port,
            "client_type": kind, "command": " ".join(args)}


class Monitor:
    """Every command Redis runs, with the connection (address:port) that sent it, from a thread (each line
    parsed by :func:`parse_monitor_line`)."""

    def __init__(self, redis_url: str) -> None:
        self.commands: list[dict[str, Any]] = []
        self._client = redis.Redis.from_url(redis_url)
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def _run(self) -> None:
        with self._client.monitor() as monitor:
            self._ready.set()
            try:
                while True:
                    raw = monitor.connection.read_response()
                    line = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
                    self.commands.append(parse_monitor_line(line))
            except (redis.RedisError, OSError, ValueError, AttributeError):
                # closed at the end of the test (redis-py may report the closed socket as a timeout); a failure
                # before that stops the recording, and the test's wait for its marker command says so
                return

    def close(self) -> None:
        self._client.close()


def _sender(command: dict[str, Any]) -> str:
    return f"{command.get('client_address')}:{command.get('client_port')}"


def test_the_cancel_mark_rides_in_the_take_pipeline(fleet: Fleet) -> None:
    cfg = fleet.config()
    fleet.worker(cfg)
    client = fleet.client(cfg)
    client.result(client.submit("demo-lm", [1, 2]), wait=True, timeout_s=60)  # connections set up
    monitor = Monitor(fleet.redis_url)
    ids = [client.submit("demo-lm", [3, i + 4]) for i in range(3)]
    for rid in ids:
        assert client.result(rid, wait=True, timeout_s=60) is not None
    commands = list(monitor.commands)
    monitor.close()
    for rid in ids:
        exists = [i for i, c in enumerate(commands) if c["command"] == f"EXISTS fleet:cancel:{rid}"]
        assert len(exists) == 1, [c["command"][:80] for c in commands]
        at = exists[0]
        hset = next(i for i in range(at - 1, -1, -1) if _sender(commands[i]) == _sender(commands[at]))
        assert commands[hset]["command"].startswith("HSET unacked ") and rid in commands[hset]["command"]
        zadd = next(i for i in range(hset - 1, -1, -1) if _sender(commands[i]) == _sender(commands[at]))
        assert commands[zadd]["command"].startswith("ZADD unacked_index ")


def test_a_request_cancelled_while_queued_is_not_run(fleet: Fleet) -> None:
    cfg = fleet.config()
    client = fleet.client(cfg)
    doomed = client.submit("demo-lm", [5, 6, 7])
    assert client.cancel(doomed) is True  # no worker yet: it waits in the queue
    fleet.worker(cfg)  # started after the cancel: Celery's revoke broadcast never reached it
    with pytest.raises(RequestCancelled):
        client.result(doomed, wait=True, timeout_s=60)
    assert client.result(client.submit("demo-lm", [8, 9]), wait=True, timeout_s=60) is not None


def test_marks_are_taken_once_and_the_oldest_dropped() -> None:
    marks = CancelMarks(limit=2)
    marks.note("a", True)
    marks.note("b", False)
    marks.note("c", False)  # "a" is dropped: its task reads the mark with EXISTS instead
    assert marks.take("a") is None and marks.take("b") is False and marks.take("c") is False
    assert marks.take("b") is None and len(marks) == 0


def test_the_unacked_entry_splices_the_taken_bytes_into_kombu_s_json() -> None:
    import json
    from types import SimpleNamespace

    from broker.batch_take import unacked_entry_of
    from broker.cancel_marks import unacked_entry

    raw = (b'{"body": "W1tdLCB7fV0=", "headers": {"id": "r-1", "task": "fleet.infer"}, '
           b'"properties": {"delivery_tag": "t"}}')
    message = SimpleNamespace(_raw=json.loads(raw))
    delivery = {"exchange": "fleet.demo-lm", "routing_key": "fleet.demo-lm"}
    spliced, encoded = unacked_entry_of(raw, delivery), unacked_entry(message, delivery)
    assert isinstance(spliced, bytes) and raw in spliced  # the bytes as taken, not encoded again
    assert json.loads(spliced) == json.loads(encoded) == [json.loads(raw), "fleet.demo-lm", "fleet.demo-lm"]


def test_a_monitor_line_whose_argument_ends_in_a_backslash_keeps_its_other_arguments() -> None:
    """Generated token text can end in a backslash; redis-py's own MONITOR parser then swallowed the arguments
    after it (a CI run missed a result's SUCCESS store that way)."""
    got = parse_monitor_line(r'1733.5 [0 127.0.0.1:5555] "XADD" "fleet:stream:r" "*" "t" "ab\\" "i" "3"')
    assert got["command"] == "XADD fleet:stream:r * t ab\\ i 3"
    assert (got["client_address"], got["client_port"], got["client_type"]) == ("127.0.0.1", "5555", "tcp")
    line = r'1733.5 [0 lua] "SET" "celery-task-meta-r" "{\"status\": \"SUCCESS\", \"t\": \"\\x06\"}"'
    store = parse_monitor_line(line)
    assert store["command"] == r'SET celery-task-meta-r {"status": "SUCCESS", "t": "\x06"}'
    assert store["client_type"] == "lua"
