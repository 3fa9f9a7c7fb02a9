"""``broker.cancel_marks``: the cancel mark is read in the pipeline that takes a message (real worker,
real redis-server, Redis's own MONITOR), and a request cancelled while queued is not run."""

from __future__ import annotations

import threading
import time
from typing import Any
from urllib.parse import urlparse

import psutil
import pytest

from broker.cancel_marks import CancelMarks
from protocol.errors import RequestCancelled, RequestNotFound
from tests.integration.fleet_fixtures import Fleet
from tests.integration.redis_monitor import Monitor, parse_monitor_line, worker_mark_reads


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
    commands = monitor.up_to_now()
    monitor.close()
    for rid in ids:
        exists = worker_mark_reads(commands, rid)  # the waiting client reads it too, with the result key
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
    fleet.worker(cfg)  # started after the cancel: only the mark in Redis tells it
    with pytest.raises(RequestCancelled):
        client.result(doomed, wait=True, timeout_s=60)
    assert client.result(client.submit("demo-lm", [8, 9]), wait=True, timeout_s=60) is not None
    # an ID nobody sent: refused, as the gateway (404) and `fleet cancel` (exit 1) refuse it, and no mark is
    # left to cancel a request later sent under that ID (before: True, and that request never ran)
    with pytest.raises(RequestNotFound):
        client.cancel("never-sent-1")
    assert client.result(client.submit("demo-lm", [8, 9], request_id="never-sent-1"), wait=True,
                         timeout_s=60) is not None  # fmt: skip


def _sockets_to(port: int) -> int:
    """This process's open TCP connections to ``port`` on the loopback."""
    return sum(1 for c in psutil.Process().net_connections("tcp")
               if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED)  # fmt: skip


def test_many_concurrent_cancels_all_return_and_close_releases_every_connection(fleet: Fleet) -> None:
    """32 threads cancel 64 queued requests, two rounds at once (as the gateway's DELETE route does from its thread
    pool): each cancel returns True, no request runs, and close() leaves no connection open. Before, cancel also
    sent Celery's revoke broadcast, which takes two connections of the app's pool (10) per call: 10 calls at once
    held them all and waited for a second one forever, and the pool's sockets outlived close()."""
    cfg = fleet.config()
    client = fleet.client(cfg)
    ids = [client.submit("demo-encoder", [5, 6, i + 7]) for i in range(64)]  # no encoder worker yet: they wait
    barrier = threading.Barrier(32)
    answers: dict[str, bool] = {}

    def cancel(mine: list[str]) -> None:
        for rid in mine:
            barrier.wait()
            answers[rid] = client.cancel(rid)

    threads = [threading.Thread(target=cancel, args=(ids[i::32],), daemon=True) for i in range(32)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = sum(t.is_alive() for t in threads)
    assert stuck == 0, f"{stuck} of 32 threads are stuck in a cancel"
    assert answers == dict.fromkeys(ids, True)
    port = urlparse(fleet.redis_url).port
    assert port is not None
    client.close()
    assert _sockets_to(port) == 0
    fleet.worker(cfg, model="demo-encoder")
    reader = fleet.client(cfg)
    assert all(isinstance(outcome, RequestCancelled) for outcome in reader.wait(ids, timeout_s=60))


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
    delivery = {"exchange": "", "routing_key": "fleet.demo-lm"}
    spliced, encoded = unacked_entry_of(raw, "fleet.demo-lm"), unacked_entry(message, delivery)
    assert isinstance(spliced, bytes) and raw in spliced  # the bytes as taken, not encoded again
    assert json.loads(spliced) == json.loads(encoded) == [json.loads(raw), "", "fleet.demo-lm"]


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
