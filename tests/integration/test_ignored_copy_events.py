"""An ignored copy of a generation's ID ends in Celery's task events as its stored outcome, so Flower shows it
finished; nothing is stored or streamed for it.

Real redis-server, a real ``celery worker`` subprocess (events on, ``-E``) and a real
``celery.events.EventReceiver`` feeding ``celery.events.state.State``, the state Flower keeps. The receiver
starts after the first deliveries ended (Flower started later, or that worker's events were lost); the copies
are then queued as a plain Celery client would send them. Before, the worker acked each copy with Celery's
``Ignore``, which sends no event: the receiver had the copy's task-received and task-started and nothing
after, so the ID showed STARTED for ever.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

import redis

from broker import make_celery
from protocol.celeryconf import celery_config
from protocol.keys import RESULT_KEY, STREAM_KEY
from protocol.settings import load_settings
from tests.integration.fleet_fixtures import Fleet
from tests.integration.ops_fixtures import wait_until
from tests.queue_items import envelope, good_body, raw

QUEUE = "fleet.demo-lm"
LIMIT = 64
"""The model's ``max_new_tokens`` here: a generation asking for more fails (a stored FAILURE)."""


def _generation(new_tokens: int) -> dict[str, Any]:
    generation = {"max_new_tokens": new_tokens, "ignore_eos": True}
    return {"model": "demo-lm", "input_ids": [5, 6, 7], "output": {"kind": "generate", "generation": generation}}


class FlowerView:
    """Every event the fleet publishes, applied to ``celery.events.state.State`` as Flower applies them."""

    def __init__(self, redis_url: str) -> None:
        self.app = make_celery(celery_config(load_settings(redis_url=redis_url)), "flower-view")
        self.state = self.app.events.State()
        self.types: dict[str, list[str]] = defaultdict(list)
        self._lock = threading.Lock()
        self._receiver: Any = None
        self._thread = threading.Thread(target=self._run, name="flower-view", daemon=True)
        self._thread.start()
        wait_until(self._subscribed, 30, "the receiver to get an event sent to it", poll_s=0.2)

    def _run(self) -> None:
        with self.app.connection_for_read() as conn:
            self._receiver = self.app.events.Receiver(conn, handlers={"*": self._on_event})
            self._receiver.capture(limit=None, timeout=None, wakeup=False)

    def _on_event(self, event: dict[str, Any]) -> None:
        with self._lock:
            self.state.event(event)
            self.types[str(event.get("uuid") or event.get("hostname"))].append(str(event["type"]))

    def _subscribed(self) -> bool:
        """Whether a ping sent by an earlier call arrived; sends one more (those sent before the receiver
        subscribed are lost)."""
        arrived = "fleet-view-ping" in self.seen("view@test")
        with self.app.events.default_dispatcher(hostname="view@test") as dispatcher:
            dispatcher.send("fleet-view-ping")
        return arrived

    def seen(self, key: str) -> list[str]:
        with self._lock:
            return list(self.types.get(key, ()))

    def task(self, task_id: str) -> tuple[str | None, Any, Any]:
        """``task_id``'s state, result and exception as Flower shows them."""
        with self._lock:
            task = self.state.tasks.get(task_id)
            return (None, None, None) if task is None else (str(task.state), task.result, task.exception)

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.should_stop = True
        self._thread.join(10)
        self.app.close()


def _count(log: Path | None, text: str) -> int:
    return log.read_text(errors="replace").count(text) if log is not None and log.exists() else 0


def test_ignored_copies_end_in_flower_as_their_stored_outcome(fleet: Fleet) -> None:
    cfg = fleet.config(models={"demo-lm": {"limits": {"max_new_tokens": LIMIT}}})
    worker = fleet.worker(cfg)
    client = fleet.client(cfg)
    r = redis.Redis.from_url(fleet.redis_url)
    saw_all = FlowerView(fleet.redis_url)  # a Flower that saw the first deliveries end, too
    requests = {"copy-ok": _generation(8), "copy-bad": _generation(LIMIT + 1)}
    for rid, request in requests.items():
        r.lpush(QUEUE, raw(envelope(QUEUE, good_body(request), task_id=rid)))
    wait_until(lambda: all(r.exists(RESULT_KEY.format(id=rid)) for rid in requests), 60, "both outcomes stored")
    wait_until(lambda: r.hlen("unacked") == 0, 30, "both deliveries acked")
    stored = {rid: r.get(RESULT_KEY.format(id=rid)) for rid in requests}
    streams = {rid: r.xrange(STREAM_KEY.format(id=rid)) for rid in requests}

    wait_until(lambda: all(saw_all.task(rid)[0] in ("SUCCESS", "FAILURE") for rid in requests), 30,
               "the first deliveries' ends")  # fmt: skip
    first_seen = {rid: saw_all.task(rid) for rid in requests}
    view = FlowerView(fleet.redis_url)  # started after the first deliveries ended
    try:
        for rid, request in requests.items():
            r.lpush(QUEUE, raw(envelope(QUEUE, good_body(request), task_id=rid)))
        wait_until(lambda: _count(worker.log_path, "already has its outcome stored") == 2, 60,
                   "both copies skipped")  # fmt: skip
        wait_until(lambda: r.hlen("unacked") == 0 and r.llen(QUEUE) == 0, 30, "both copies acked")
        # a later request's end comes after every event the worker sent for the copies
        marker = client.submit("demo-lm", [3, 4])
        assert client.result(marker, wait=True, timeout_s=60) is not None
        wait_until(lambda: "task-succeeded" in view.seen(marker), 30, "the later request's end")

        for rid in requests:
            assert {"task-received", "task-started"} <= set(view.seen(rid)), view.seen(rid)
        assert view.task("copy-ok")[0] == "SUCCESS", view.seen("copy-ok")  # old: STARTED
        assert view.task("copy-bad")[0] == "FAILURE", view.seen("copy-bad")  # old: STARTED
        wait_until(lambda: "task-succeeded" in saw_all.seen(marker), 30, "the later request's end (first view)")
        # what the first deliveries' ends showed (their result, their exception) is what Flower still shows
        assert {rid: saw_all.task(rid) for rid in requests} == first_seen
        assert first_seen["copy-ok"][1] and first_seen["copy-bad"][2], first_seen
        assert {rid: r.get(RESULT_KEY.format(id=rid)) for rid in requests} == stored  # nothing stored
        assert {rid: r.xrange(STREAM_KEY.format(id=rid)) for rid in requests} == streams  # nothing streamed
    finally:
        view.close()
        saw_all.close()
