"""``broker.batch_take``: a backed-up queue is taken several messages per round trip, never more than
the worker's free tokens, with each message's bookkeeping and cancel mark, the guard's checks and
the store's ack as for one (real worker, real redis-server, Redis's own MONITOR)."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import redis
from kombu.transport import virtual

from broker.batch_take import RETAG, room_for_more
from protocol.errors import RequestCancelled
from protocol.keys import DEAD_LETTER_KEY
from tests.integration.fleet_fixtures import Fleet
from tests.integration.redis_monitor import Monitor, worker_mark_reads
from tests.queue_items import shared_tag_generations
from tools.processes import poll_until
from tools.redis_server import EmbeddedRedis

TOKENS = 4
"""The worker's concurrency C in these tests."""
SMALL = {"worker": {"concurrency": TOKENS}, "models": {"demo-lm": {"batching": {"max_batch_size": TOKENS}}}}
"""Config overrides for a worker of :data:`TOKENS` tokens."""


def _by_sender(commands: list[dict[str, Any]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for c in commands:
        out.setdefault(f"{c.get('client_address')}:{c.get('client_port')}", []).append(str(c["command"]))
    return out


def _recorded_together(commands: list[dict[str, Any]]) -> list[int]:
    """Sizes of each run of deliveries recorded back to back on one connection or in one script run
    (``HEXISTS``/``ZADD``/``HSET``/``EXISTS``)."""
    runs: list[int] = []
    for sent in _by_sender(commands).values():
        count = 0
        for command in [*sent, "END"]:
            if command.startswith(("ZADD unacked_index ", "EXISTS fleet:cancel:", "HEXISTS unacked ")):
                continue
            if command.startswith("HSET unacked "):
                count += 1
                continue
            if count:
                runs.append(count)
            count = 0
    return runs


def _takes(commands: list[dict[str, Any]], queue: str) -> list[list[str]]:
    """The take script's runs on ``queue``: the commands of each, from its ``LRANGE`` to its ``LTRIM``."""
    runs: list[list[str]] = []
    for c in commands:
        command = str(c["command"])
        if c.get("client_type") != "lua":
            continue
        if command.startswith(f"LRANGE {queue} "):
            runs.append([command])
        elif runs and not runs[-1][-1].startswith("LTRIM "):
            runs[-1].append(command)
    return runs


def _most_held(commands: list[dict[str, Any]]) -> int:
    """The most deliveries kombu's unacked hash held at once, replayed from the commands that write it
    (``HSET``/``HSETNX`` add a tag, ``HDEL`` removes tags) in the order Redis ran them."""
    held: set[str] = set()
    most = 0
    for c in commands:
        words = str(c["command"]).split(" ")
        if len(words) < 3 or words[1] != "unacked":
            continue
        if words[0] in ("HSET", "HSETNX"):
            held.add(words[2])
        elif words[0] == "HDEL":
            held.difference_update(words[2:])
        most = max(most, len(held))
    return most


def test_a_backed_up_queue_is_taken_in_batches_within_the_tokens(fleet: Fleet) -> None:
    cfg = fleet.config(**SMALL)
    client = fleet.client(cfg)
    r = redis.Redis.from_url(fleet.redis_url)
    queue = client.settings.queue_for("demo-lm")
    ids = [client.submit("demo-lm", [3, i + 4]) for i in range(7)]
    r.lpush(queue, b"not a kombu envelope")  # a poison item among them: dead-lettered, the rest unharmed
    ids += [client.submit("demo-lm", [4, i + 4]) for i in range(7)]
    cancelled = ids[2::5]
    for rid in cancelled:
        assert client.cancel(rid) is True
    monitor = Monitor(fleet.redis_url)
    fleet.worker(cfg, concurrency=TOKENS)  # started with 15 items waiting
    for rid in ids:
        if rid in cancelled:
            with pytest.raises(RequestCancelled):
                client.result(rid, wait=True, timeout_s=60)
        else:
            assert client.result(rid, wait=True, timeout_s=60) is not None
    fleet.workers[0].stop(timeout_s=20)
    commands = monitor.up_to_now()
    monitor.close()

    assert not [c for c in commands if c["command"].startswith(("BRPOP", "RPOP"))]  # nothing popped unrecorded
    assert any(c["command"].startswith(f"BLMOVE {queue} {queue} RIGHT RIGHT") for c in commands)  # the wait
    takes = _takes(commands, queue)
    assert takes and all(1 <= -int(run[0].split(" ")[2]) <= TOKENS for run in takes), takes  # LRANGE q -n -1
    trimmed = [-int(run[-1].split(" ")[3]) - 1 for run in takes if run[-1].startswith(f"LTRIM {queue} 0 ")]
    recorded = [sum(1 for c in run if c.startswith("HSET unacked ")) for run in takes]
    assert sum(trimmed) == len(ids) + 1 and sum(recorded) == len(ids)  # every item taken, each recorded in
    # the script run that trimmed it off the list, but the poison item (no delivery tag: dead-lettered)
    together = _recorded_together(commands)
    assert max(together) >= 2, together  # several deliveries recorded in one step
    assert 2 <= _most_held(commands) <= TOKENS  # never more unacked deliveries than tokens
    for rid in ids:  # each cancel mark read once, in a take pipeline; no task thread read it again
        assert len(worker_mark_reads(commands, rid)) == 1, rid  # (a waiting client's read of it not counted)
    assert r.llen(DEAD_LETTER_KEY) == 1
    assert r.hlen("unacked") == 0 and r.zcard("unacked_index") == 0 and r.llen(queue) == 0


@pytest.mark.parametrize(("denied", "warnings"), [
    ("-blmove -rpop", ["Redis refused BLMOVE", "taking one message per round trip"]),
    ("-ltrim", ["Redis refused a command of the take script"]),
])
def test_a_redis_that_refuses_the_atomic_take_is_taken_with_brpop(
    tmp_path: Path, model_dir: Path, denied: str, warnings: list[str]
) -> None:
    """BLMOVE's or the take script's refusal (an ACL here; Redis before 6.2 has no BLMOVE) turns the
    atomic take off: kombu's BRPOP, batched with RPOP n; RPOP's refusal (Redis before 6.2 refuses its
    count) turns the batches off too."""
    acl = [f"fleet on >batch-take-test ~* &* +@all {denied}", "default off"]
    with EmbeddedRedis(username="fleet", password="batch-take-test", acl=acl) as server:
        fleet = Fleet(tmp_path, model_dir, server.url)
        try:
            cfg = fleet.config(**SMALL)
            client = fleet.client(cfg)
            ids = [client.submit("demo-lm", [5, i + 4]) for i in range(6)]
            worker = fleet.worker(cfg, concurrency=TOKENS)
            for rid in ids:
                assert client.result(rid, wait=True, timeout_s=60) is not None
            assert worker.log_path is not None
            log_path = worker.log_path
            for warning in warnings:
                poll_until(partial(_logged, log_path, warning), 10, f"the warning {warning!r}")
            assert worker.proc is not None and worker.proc.poll() is None  # the worker lives on
            r = server.client()
            assert client.result(client.submit("demo-lm", [6, 7]), wait=True, timeout_s=60) is not None
            assert r.llen(client.settings.queue_for("demo-lm")) == 0
        finally:
            fleet.close()


def test_a_worker_taking_with_brpop_gives_back_each_message_that_shared_a_tag(tmp_path: Path, model_dir: Path) -> None:
    """Three generations a sender queued under one delivery tag, taken with ``BRPOP`` (the take script refused:
    an ACL without ``LTRIM``) and running on a worker that is then SIGKILLed: each has an unacked entry of its
    own to be restored from, as with the atomic take. Before, each ``HSET`` overwrote the last one's entry:
    one entry for three, the other two lost for good."""
    acl = ["fleet on >batch-take-test ~* &* +@all -ltrim", "default off"]
    with EmbeddedRedis(username="fleet", password="batch-take-test", acl=acl) as server:
        fleet = Fleet(tmp_path, model_dir, server.url)
        try:
            cfg = fleet.config(models={"demo-lm": {"limits": {"max_new_tokens": 480}}})
            worker = fleet.worker(cfg)
            client = fleet.client(cfg)
            r = server.client()
            queue = client.settings.queue_for("demo-lm")
            ids = [f"brpop-shared-tag-{n}" for n in range(3)]
            r.lpush(queue, *shared_tag_generations(queue, ids))
            for rid in ids:  # every one is running (a first token out of 480): held, unacked
                assert next(iter(client.stream(rid, timeout_s=60))).type == "token"
            assert worker.log_path is not None and "Redis refused a command of the take script" in \
                worker.log_path.read_text()  # taken with BRPOP
            worker.kill()
            held = {json.loads(entry)[0]["headers"]["id"] for entry in r.hvals("unacked")}
            assert held == set(ids), f"unacked entries for {sorted(held)}; tags {r.hkeys('unacked')}"
            assert r.zcard("unacked_index") == 3
            assert {t.decode() for t in r.hkeys("unacked")} >= {"one-tag-for-all"}
            assert all(t.decode().startswith("one-tag-for-all" + RETAG) for t in r.hkeys("unacked")
                       if t != b"one-tag-for-all")  # fmt: skip
        finally:
            fleet.close()


def _logged(log_path: Path, text: str) -> bool:
    return text in log_path.read_text()


class _Channel:
    """What kombu's QoS reads off its channel here (and when it is collected: nothing to restore)."""

    do_restore = False


@pytest.mark.parametrize(("prefetch", "held", "room"), [(4, 0, 3), (4, 3, 0), (4, 2, 1), (1, 0, 0), (0, 0, 0)])
def test_room_for_more_is_the_free_tokens_beside_the_message_just_popped(prefetch: int, held: int, room: int) -> None:
    qos = virtual.QoS(_Channel(), prefetch_count=prefetch)  # type: ignore[no-untyped-call]
    for i in range(held):
        qos._delivered[f"tag-{i}"] = object()
    assert room_for_more(qos) == room
