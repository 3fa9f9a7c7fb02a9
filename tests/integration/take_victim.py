"""A process that takes a backed-up queue with the worker's real channel and is SIGKILLed at random instants.

``python -m tests.integration.take_victim kill --redis-url URL --kills N --out report.json`` keeps the
queue backed up with real Celery envelopes of ``fleet.infer`` (one captured from ``send_task``, copied
with fresh IDs and delivery tags), and N times forks a child that consumes it exactly as a worker's
event loop does: kombu's Redis transport with :class:`broker.poison.GuardedChannel` installed (the
guard, the batched take, the cancel mark at take), prefetch = the worker's tokens, each message stored
through the worker's result backend (whose script acks it, :mod:`broker.store_ack`) and acked. Once
the child has delivered its first message the parent waits a random 0..``max_delay_s`` and SIGKILLs
it, then reads where every pushed ID is: the queue, kombu's unacked hash, or stored (delivered and
acked). The report holds, per kill, the delay, the code the child was in (a shared byte the child sets
as it enters and leaves the take's steps) and how many IDs were then in none of the three places.

``... drain --redis-url URL`` then does what kombu's visibility-timeout restore does for a dead worker
(``QoS.restore_by_tag`` of every unacked entry) and consumes until the queue and the unacked hash are
empty. Fork is used so that 200 kills fit in seconds: the child runs the fleet's code, freshly
connected, in a process of its own.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import select
import signal
import sys
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import redis
from celery import Celery, states
from kombu.entity import Queue
from kombu.messaging import Consumer

from broker import make_celery, poison, result_backend
from protocol.celeryconf import celery_config
from protocol.settings import load_settings

PUSHED_KEY = "take-test:pushed"
"""The set of every task ID the driver queued (written in the same MULTI as the message)."""
MODEL = "demo-lm"
PHASES = ("outside the take (event loop, wait)", "take: reading the reply and taking",
          "take: script round trip", "take: bookkeeping pipeline", "guard checks", "delivery to the consumer",
          "store + ack script")
"""Where a child can be; index = the byte it writes. Steps the code under test lacks are never entered."""


def _settings(redis_url: str) -> Any:
    return load_settings(redis_url=redis_url, visibility_timeout_s=3600)  # no restore during the kills


def _app(redis_url: str) -> Celery:
    app = make_celery(celery_config(_settings(redis_url)), "take-victim")
    result_backend.install(app)

    def infer(*_args: Any, **_kwargs: Any) -> None:
        return None

    app.task(name="fleet.infer")(infer)  # the guard runs registered fleet task names only

    poison.install(app, _settings(redis_url), "take-victim@test")
    return app


def _template(redis_url: str, queue: str) -> dict[str, Any]:
    """A real envelope as a producer writes it to ``queue`` (``send_task`` of a separate app, closed after)."""
    producer = make_celery(celery_config(_settings(redis_url)), "take-victim-producer")
    producer.send_task("fleet.infer", args=[{"model": MODEL, "input_ids": [3, 4]}], queue=queue)
    producer.close()
    r = redis.Redis.from_url(redis_url)
    raw = r.rpop(queue)  # before any consumer runs
    r.close()
    assert raw is not None, "send_task wrote no message"
    doc: dict[str, Any] = json.loads(raw)
    return doc


def _push(r: redis.Redis[bytes], template: dict[str, Any], queue: str, count: int) -> None:
    pipe = r.pipeline(transaction=True)
    for _ in range(count):
        tid = str(uuid.uuid4())
        doc = json.loads(json.dumps(template))
        doc["headers"].update(id=tid, root_id=tid)
        doc["properties"].update(correlation_id=tid, delivery_tag=str(uuid.uuid4()))
        pipe.lpush(queue, json.dumps(doc))
        pipe.sadd(PUSHED_KEY, tid)
    pipe.execute()


def _instrument(phase: mmap.mmap) -> None:
    """In the child: each step of the take writes its index to ``phase`` while it runs."""
    atomic_take: Any
    try:
        from broker import atomic_take
    except ImportError:  # code without the atomic take
        atomic_take = None

    def wrap(owner: Any, name: str, code: int) -> None:
        original = getattr(owner, name, None)
        if original is None:
            return

        def step(*args: Any, **kwargs: Any) -> Any:
            before = phase[0]
            phase[0] = code
            try:
                return original(*args, **kwargs)
            finally:
                phase[0] = before

        setattr(owner, name, step)

    channel = poison.GuardedChannel
    wrap(channel, "_brpop_read", 1)
    if atomic_take is not None:
        wrap(atomic_take, "_run_script", 2)
    wrap(channel, "_record", 3)
    wrap(channel, "_check", 4)
    wrap(channel, "_deliver_checked", 5)


def _consume(app: Celery, queue: str, tokens: int, on_first: Callable[[], None], phase: mmap.mmap | None,
             until_empty: redis.Redis[bytes] | None = None) -> None:
    """Consume ``queue`` (and its canary queue, as a worker does) through the guarded channel."""
    delivered = 0

    def on_message(_body: Any, message: Any) -> None:
        nonlocal delivered
        if phase is not None:
            phase[0] = 6
        request = SimpleNamespace(properties={"delivery_tag": message.delivery_tag})
        app.backend.store_result(message.headers["id"], {"served": True}, states.SUCCESS, request=request)
        message.ack()  # the store script acked it: kombu's in-memory bookkeeping only
        if phase is not None:
            phase[0] = 5
        delivered += 1
        if delivered == 1:
            on_first()

    with app.connection_for_read() as conn:
        queues = [Queue(queue), Queue(queue + ".canary")]  # type: ignore[no-untyped-call]
        consumer = Consumer(conn, queues=queues, callbacks=[on_message], accept=["json"],  # type: ignore[no-untyped-call]
                            prefetch_count=tokens)
        with consumer:
            while True:
                try:
                    conn.drain_events(timeout=1)
                except TimeoutError:
                    pass
                except OSError as exc:  # socket.timeout is an OSError
                    if "timed out" not in str(exc):
                        raise
                if until_empty is not None and not until_empty.llen(queue) and not until_empty.hlen("unacked"):
                    return


def _where(r: redis.Redis[bytes], queue: str, known_done: set[str]) -> dict[str, int]:
    """Counts of the pushed IDs by place; ``lost`` = in none of queue, unacked, stored."""
    pushed = {m.decode() for m in r.smembers(PUSHED_KEY)}
    queued = [json.loads(raw)["headers"]["id"] for raw in r.lrange(queue, 0, -1)]
    unacked = [json.loads(entry)[0]["headers"]["id"] for entry in r.hvals("unacked")]
    rest = sorted(pushed - known_done - set(queued) - set(unacked))
    if rest:
        metas = r.mget([f"celery-task-meta-{tid}" for tid in rest])
        known_done.update(tid for tid, meta in zip(rest, metas, strict=True) if meta is not None)
    seen = Counter(queued) + Counter(unacked) + Counter(t for t in pushed if t in known_done)
    return {"pushed": len(pushed), "queued": len(queued), "unacked": len(unacked), "stored": len(known_done),
            "lost": sum(1 for t in pushed if seen[t] == 0), "in_two_places": sum(1 for t in pushed if seen[t] > 1)}


def _victim(app: Celery, queue: str, tokens: int, ready_write: int, phase: mmap.mmap) -> int:
    """The forked child's life: consume until killed; its exit code when something raised instead."""

    def ready() -> None:
        os.write(ready_write, b"1")

    try:
        _instrument(phase)
        _consume(app, queue, tokens, ready, phase)
    except BaseException:  # report, and leave without running the parent's cleanup
        traceback.print_exc()
        return 1
    return 0


def kill(args: argparse.Namespace) -> dict[str, Any]:
    app = _app(args.redis_url)
    queue = _settings(args.redis_url).queue_for(MODEL)
    template = _template(args.redis_url, queue)
    r = redis.Redis.from_url(args.redis_url)
    rng = random.Random(args.seed)
    phase = mmap.mmap(-1, 1)  # anonymous, shared with the forked children
    known_done: set[str] = set()
    kills: list[dict[str, Any]] = []
    lost_before = 0
    for _ in range(args.kills):
        depth = int(r.llen(queue))
        if depth < args.depth:
            _push(r, template, queue, args.depth - depth)
        ready_read, ready_write = os.pipe()
        phase[0] = 0
        pid = os.fork()
        if pid == 0:  # the victim
            os.close(ready_read)
            os._exit(_victim(app, queue, args.tokens, ready_write, phase))
        os.close(ready_write)
        readable, _, _ = select.select([ready_read], [], [], args.ready_timeout_s)
        os.close(ready_read)
        if not readable:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise SystemExit(f"the victim delivered nothing in {args.ready_timeout_s} s")
        delay_s = rng.uniform(0.0, args.max_delay_s)
        time.sleep(delay_s)  # the random instant of the kill (the fault injected), not a wait for a condition
        os.kill(pid, signal.SIGKILL)
        landed = PHASES[phase[0]] if phase[0] < len(PHASES) else str(phase[0])
        _, status = os.waitpid(pid, 0)
        where = _where(r, queue, known_done)
        kills.append({"delay_s": round(delay_s, 4), "landed": landed, "killed": os.WIFSIGNALED(status),
                      "lost_by_this_kill": where["lost"] - lost_before, **where})
        lost_before = where["lost"]
    final = _where(r, queue, known_done)
    landed_at = Counter(k["landed"] for k in kills)
    lost_at = Counter({k["landed"]: 0 for k in kills})
    for k in kills:
        lost_at[k["landed"]] += k["lost_by_this_kill"]
    return {"kills": len(kills), "killed_by_sigkill": sum(k["killed"] for k in kills), "final": final,
            "landed": dict(landed_at), "lost_by_where_landed": dict(lost_at),
            "kills_that_lost": sum(1 for k in kills if k["lost_by_this_kill"] > 0),
            "poison_module": poison.__file__, "per_kill": kills}


def drain(args: argparse.Namespace) -> dict[str, Any]:
    """Restore every unacked entry as kombu's visibility-timeout restore does, then serve everything."""
    app = _app(args.redis_url)
    queue = _settings(args.redis_url).queue_for(MODEL)
    r = redis.Redis.from_url(args.redis_url)
    tags = [t.decode() for t in r.hkeys("unacked")]
    with app.connection_for_read() as conn:
        qos = conn.default_channel.qos
        for tag in tags:
            qos.restore_by_tag(tag)
    _consume(app, queue, args.tokens, lambda: None, None, until_empty=r)
    return {"restored": len(tags), "poison_module": poison.__file__, **_where(r, queue, set())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("mode", choices=["kill", "drain"])
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--kills", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--depth", type=int, default=24, help="the queue is topped up to this before each fork")
    parser.add_argument("--max-delay-s", type=float, default=0.03)
    parser.add_argument("--ready-timeout-s", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=18)
    args = parser.parse_args(argv)
    report = kill(args) if args.mode == "kill" else drain(args)
    with open(args.out, "w") as out:
        json.dump(report, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
