"""``producer.task_writer``: the task and its task-sent event, as ``Celery.send_task`` writes them, in one
pipeline; against a real redis-server, compared field by field with ``send_task``'s own output."""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import pytest
import redis

from bench.procs import redis_commandstats
from producer.admission import Admission
from protocol.messages import TASK_NAME
from tests.integration.fleet_fixtures import Fleet

ID_FIELDS = {"id", "root_id", "argsrepr", "uuid", "args", "timestamp", "clock", "delivery_tag", "correlation_id",
             "request_id", "submitted_at_unix_s"}
"""Fields that name the request or the moment, so differ between two submits by design."""


def _decoded(raw: bytes) -> dict[str, Any]:
    envelope: dict[str, Any] = json.loads(raw)
    envelope["body"] = json.loads(base64.b64decode(envelope["body"]))
    return envelope


def _same_but_ids(ours: Any, theirs: Any, path: str = "") -> list[str]:
    """Paths where ``ours`` and ``theirs`` differ, ignoring :data:`ID_FIELDS` values and request bodies."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        out = [f"{path}.{k}: only in send_task's" for k in theirs.keys() - ours.keys()]
        out += [f"{path}.{k}: only in ours" for k in ours.keys() - theirs.keys()]
        for k in ours.keys() & theirs.keys():
            if k not in ID_FIELDS:
                out += _same_but_ids(ours[k], theirs[k], f"{path}.{k}")
        return out
    if isinstance(ours, list) and isinstance(theirs, list) and len(ours) == len(theirs):
        pairs = enumerate(zip(ours, theirs, strict=True))
        return [d for i, (a, b) in pairs for d in _same_but_ids(a, b, f"{path}[{i}]")]
    return [] if ours == theirs else [f"{path}: {ours!r} != {theirs!r}"]


def test_the_written_task_and_event_match_what_send_task_writes(fleet: Fleet) -> None:
    client = fleet.client(fleet.config())
    queue = client.settings.queue_for("demo-lm")
    r = redis.Redis.from_url(fleet.redis_url)
    events = r.pubsub()
    events.psubscribe("*celeryev*")
    confirmed = events.get_message(timeout=10)  # Redis's reply: from here on every event reaches us
    assert confirmed is not None and confirmed["type"] == "psubscribe", confirmed
    assert client.writer.usable()
    ours_id = client.submit("demo-lm", [5, 6, 7], text=None)
    client.writer._usable = False  # the same client, through Celery's send_task
    theirs_id = client.submit("demo-lm", [5, 6, 7])
    raw = r.lrange(queue, 0, -1)  # LPUSH: the newest first
    theirs, ours = _decoded(raw[0]), _decoded(raw[1])
    assert ours["headers"]["id"] == ours_id and theirs["headers"]["id"] == theirs_id
    assert ours["headers"]["task"] == TASK_NAME and ours["headers"]["root_id"] == ours_id
    assert ours["properties"]["correlation_id"] == ours_id
    diff = _same_but_ids(ours, theirs)
    # send_task also copies argsrepr/kwargsrepr into the properties, where nothing reads them
    assert sorted(diff) == [".properties.argsrepr: only in send_task's", ".properties.kwargsrepr: only in send_task's"]
    assert ours["body"][0][0]["input_ids"] == theirs["body"][0][0]["input_ids"] == [5, 6, 7]
    assert ours["body"][1:] == theirs["body"][1:]
    sent: list[tuple[bytes, Any]] = []
    deadline = time.monotonic() + 5
    while len(sent) < 2 and time.monotonic() < deadline:
        message = events.get_message(timeout=0.5)
        if message and message["type"] == "pmessage":
            sent.append((message["channel"], _decoded(message["data"])))
    assert len(sent) == 2, sent
    (our_channel, our_event), (their_channel, their_event) = sent
    assert our_channel == their_channel
    assert our_event["body"]["uuid"] == ours_id and their_event["body"]["uuid"] == theirs_id
    assert our_event["body"]["type"] == "task-sent" and our_event["body"]["queue"] == queue
    assert our_event["body"]["clock"] < their_event["body"]["clock"]  # the app's Lamport clock, forwarded
    assert _same_but_ids(our_event, their_event) == []


def test_one_round_trip_and_a_failed_write_leaves_the_id_free_for_a_retry(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = fleet.client(fleet.config())
    client.admission = Admission(client.redis, client.settings, monotonic=lambda: 50.0)  # the depth read holds
    client.router.clock = lambda: 50.0  # and so does the routing state's (one GET per second otherwise)
    queue = client.settings.queue_for("demo-lm")
    client.submit("demo-lm", [1])  # connections and the depth read are set up here
    before = redis_commandstats(fleet.redis_url)
    client.submit("demo-lm", [2])
    after = redis_commandstats(fleet.redis_url)
    probe = {"info", "hello", "client"}  # redis_commandstats's own connection
    calls = {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0) and k not in probe}
    # one round trip: the claim-and-queue script (producer.idempotent_queue) runs SET NX of the marker,
    # EXISTS of a stored result, LPUSH of the task and PUBLISH of its task-sent event
    assert calls == {"evalsha": 1, "set": 1, "exists": 1, "lpush": 1, "publish": 1}, calls

    def refuse(*_: Any, **__: Any) -> None:
        raise redis.ConnectionError("connection lost while queueing")

    monkeypatch.setattr(client.queuer, "_script", refuse)
    with pytest.raises(redis.ConnectionError):
        client.submit("demo-lm", [3], request_id="retry-me")
    monkeypatch.undo()
    r = redis.Redis.from_url(fleet.redis_url)
    assert r.llen(queue) == 2
    assert client.submit("demo-lm", [3], request_id="retry-me") == "retry-me"  # not "known": queued now
    assert r.llen(queue) == 3
    assert client.submit("demo-lm", [3], request_id="retry-me") == "retry-me"  # known now: not queued twice
    assert r.llen(queue) == 3
