"""Redis's own MONITOR, recorded from a thread, for tests that check which commands a part sent (and which
connection sent them): :class:`Monitor`, and :func:`parse_monitor_line` for its lines."""

from __future__ import annotations

import re
import threading
import uuid
from typing import Any

import redis

from tools.processes import poll_until

__all__ = ["Monitor", "parse_monitor_line", "worker_mark_reads"]

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
        self._marker = redis.Redis.from_url(redis_url)
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

    def up_to_now(self, timeout_s: float = 60) -> list[dict[str, Any]]:
        """Every command Redis ran before this call: sends a marker command (``GET`` of a key of its own,
        on a connection of its own) and waits until the recording reaches it. MONITOR relays commands in the
        order Redis ran them, but the recording thread reads them some time after: a list read without
        this wait can lack the last ones."""
        marker = f"monitor-marker-{uuid.uuid4().hex}"
        self._marker.get(marker)
        at = poll_until(lambda: next((i + 1 for i, c in enumerate(self.commands) if c["command"] == f"GET {marker}"),
                                     None), timeout_s, "the marker command in MONITOR's record")  # fmt: skip
        return self.commands[: at - 1]

    def close(self) -> None:
        self._client.close()
        self._marker.close()


def _sender(command: dict[str, Any]) -> str:
    return f"{command.get('client_address')}:{command.get('client_port')}"


def worker_mark_reads(commands: list[dict[str, Any]], request_id: str) -> list[int]:
    """Indexes of the reads of ``request_id``'s cancel mark that are not a waiting client's: a client waiting
    for a result reads the mark in the round trip that reads the result key (``GET celery-task-meta-…`` then
    ``EXISTS fleet:cancel:…`` on its connection), a worker in the pipeline that takes the request."""
    wanted = f"EXISTS fleet:cancel:{request_id}"
    found = []
    for at, command in enumerate(commands):
        if command["command"] != wanted:
            continue
        before = next((c for c in reversed(commands[:at]) if _sender(c) == _sender(command)), None)
        if before is None or not str(before["command"]).startswith("GET celery-task-meta-"):
            found.append(at)
    return found

