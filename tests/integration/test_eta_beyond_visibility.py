"""A plain Celery client's ``countdown`` further ahead than the visibility timeout allows is refused, not run twice.

A message with an ETA is taken at once and held, unacked, in the worker's ETA timer. Past
``visibility_timeout_s`` kombu restores it to the queue, a worker takes it again and holds it too, and
when the ETA comes it runs once per holder (Celery's caveat for Redis). The guard refuses an ETA further
ahead than half the visibility timeout (:mod:`broker.eta_window`): dead-lettered as
``eta_beyond_visibility``, with a FAILURE naming ``headers.eta``, its value and the limit. An ETA within
the limit runs, once. On the old code the far request ran (more than once) and ended SUCCESS.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.result import AsyncResult

from producer.cli import main as fleet_main
from protocol.deadletter import Reason, read_entry
from protocol.keys import DEAD_LETTER_KEY, DELIVERIES_KEY
from tests.integration.fleet_fixtures import Fleet
from tools.processes import WorkerProcess

QUEUE = "fleet.demo-lm"
VISIBILITY_S = 6  # kombu restores a held message after 6 s (its scan runs every second); the ETA limit is 3 s
FAR_S = 15  # beyond the limit and the visibility timeout: the old code held it through two restores (three copies),
# short of a fourth delivery, which max_deliveries=3 would have dead-lettered
NEAR_S = 2  # within the limit
REQUEUE_S = 10  # beyond the limit when sent; within it (and requeued) from 7 s on
REQUEST = {"model": "demo-lm", "input_ids": [5, 6, 7], "output": {"top_k": 2}}


def _runs(log: Path | None, task_id: str) -> tuple[int, int]:
    """(times the worker received ``task_id``, times it ran it to success), from the worker's log."""
    text = log.read_text() if log is not None and log.exists() else ""
    tid = re.escape(task_id)
    return (len(re.findall(rf"Task fleet\.infer\[{tid}\] received", text)),
            len(re.findall(rf"Task fleet\.infer\[{tid}\] succeeded in", text)))


def _wait_until(what: str, ok: Any, timeout_s: float, tail: Any) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"{what} not within {timeout_s} s; worker log: {tail()}"
        time.sleep(0.1)


def _started(fleet: Fleet) -> tuple[Path, WorkerProcess, redis.Redis[bytes], Celery]:
    """A worker with the short visibility timeout, a Redis client, and a plain Celery client (close it)."""
    cfg = fleet.config(visibility_timeout_s=VISIBILITY_S, worker={"heartbeat_s": 0.2})
    worker = fleet.worker(cfg)
    return cfg, worker, redis.Redis.from_url(fleet.redis_url), _plain_client(fleet)


def _plain_client(fleet: Fleet) -> Celery:
    """A plain Celery client of the fleet's Redis (close it)."""
    plain = Celery("plain", broker=fleet.redis_url, backend=fleet.redis_url)
    plain.conf.update(task_serializer="json", accept_content=["json"], result_accept_content=["json"],
                      broker_connection_retry_on_startup=False)
    return plain


def test_an_eta_beyond_the_visibility_timeout_is_refused_and_one_within_runs_once(fleet: Fleet) -> None:
    _, worker, r, plain = _started(fleet)
    try:
        far = plain.send_task("fleet.infer", args=[REQUEST], queue=QUEUE, countdown=FAR_S, task_id="eta-far-1")
        near = plain.send_task("fleet.infer", args=[REQUEST], queue=QUEUE, countdown=NEAR_S, task_id="eta-near-1")

        near_result = near.get(timeout=60, propagate=False)
        assert near.state == "SUCCESS", (near.state, near_result, worker.log_tail())
        assert near_result["request_id"] == "eta-near-1" and len(near_result["top_k"]) == 2

        far_result = far.get(timeout=60 + FAR_S, propagate=False)
        received = _runs(worker.log_path, "eta-far-1")[0]
        redelivered = r.get(DELIVERIES_KEY.format(id="eta-far-1"))
        assert far.state == "FAILURE", (f"state {far.state} ({far_result!r}); received {received} times; "
                                        f"deliveries counted: {redelivered!r}")
        message = str(far_result)
        assert message.startswith("dead-lettered (eta_beyond_visibility): headers.eta "), message
        assert "visibility_timeout_s=6 s" in message and "limit of 3 s ahead" in message, message
        assert getattr(far_result, "field", None) == "headers.eta" and getattr(far_result, "limit", None) == 3.0

        entries = [read_entry(item) for item in r.lrange(DEAD_LETTER_KEY, 0, -1)]
        assert [(e.reason, e.field, e.task_id, e.queue) for e in entries] == [
            (Reason.ETA_BEYOND_VISIBILITY, "headers.eta", "eta-far-1", QUEUE)]
        eta = json.loads(entries[0].raw_bytes())["headers"]["eta"]
        assert isinstance(eta, str) and repr(eta) in entries[0].detail and repr(eta) in message

        # acked and gone: nothing is left for kombu to restore, so neither runs (again) later
        _wait_until("every message acked", lambda: r.hlen("unacked") == 0 and r.llen(QUEUE) == 0, 30,
                    worker.log_tail)
        _wait_until("the near request's success logged", lambda: _runs(worker.log_path, "eta-near-1")[1] >= 1, 30,
                    worker.log_tail)
        assert _runs(worker.log_path, "eta-near-1") == (1, 1)
        assert _runs(worker.log_path, "eta-far-1") == (0, 0)  # refused before Celery saw it
        assert r.get(DELIVERIES_KEY.format(id="eta-near-1")) is None and redelivered is None
        assert worker.proc is not None and worker.proc.poll() is None
    finally:
        plain.close()


def test_requeue_waits_until_the_eta_is_within_the_limit_then_it_runs_once(
    fleet: Fleet, capsys: pytest.CaptureFixture[str]
) -> None:
    """``fleet dead-letter requeue`` of an ``eta_beyond_visibility`` entry is refused (exit 2, saying from when)
    while the message would bounce straight back, and puts it back once its ETA is within the limit."""
    cfg, worker, r, plain = _started(fleet)

    def dead_letter(*argv: str) -> tuple[int, Any]:
        code = fleet_main(["dead-letter", argv[0], "--config", str(cfg), *argv[1:]])
        out = capsys.readouterr().out.strip().splitlines()
        return code, json.loads(out[-1]) if out else None

    try:
        sent = plain.send_task("fleet.infer", args=[REQUEST], queue=QUEUE, countdown=REQUEUE_S, task_id="eta-back-1")
        sent.get(timeout=60, propagate=False)
        assert sent.state == "FAILURE", (sent.state, worker.log_tail())

        code, refused = dead_letter("requeue", "eta-back-1")  # still beyond the limit: it would bounce back
        assert code == 2 and refused["type"] == "InvalidRequest" and refused["field"] == "force", refused
        assert "eta_beyond_visibility" in refused["message"] and "would refuse it again until" in refused["message"]
        assert "--force" in refused["message"] and r.llen(DEAD_LETTER_KEY) == 1

        def in_reach() -> bool:
            code, shown = dead_letter("show", "eta-back-1")
            return code == 0 and shown["requeue_allowed"] is True

        _wait_until("the entry's ETA within the limit", in_reach, 30, worker.log_tail)
        code, requeued = dead_letter("requeue", "eta-back-1")
        assert code == 0 and requeued["requeued"] is True and requeued["failure_cleared"] is True, requeued
        assert requeued["forced"] is False and requeued["reason"] == "eta_beyond_visibility"

        # read by another client: Celery's result consumer keeps a ready state published after its waiter was
        # done (the first FAILURE, when the test process was starved) and hands it to the next waiter of that ID,
        # so this one would read the cleared failure (seen beside stress-ng)
        reader = _plain_client(fleet)
        try:
            again = AsyncResult("eta-back-1", app=reader)
            result = again.get(timeout=60, propagate=False)
            state = again.state
        finally:
            reader.close()
        assert state == "SUCCESS", (state, result, worker.log_tail())
        assert result["request_id"] == "eta-back-1" and r.llen(DEAD_LETTER_KEY) == 0
        _wait_until("every message acked", lambda: r.hlen("unacked") == 0 and r.llen(QUEUE) == 0, 30,
                    worker.log_tail)
        _wait_until("its success logged", lambda: _runs(worker.log_path, "eta-back-1")[1] >= 1, 30, worker.log_tail)
        assert _runs(worker.log_path, "eta-back-1") == (1, 1)
    finally:
        plain.close()
