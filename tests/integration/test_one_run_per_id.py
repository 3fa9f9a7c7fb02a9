"""Two deliveries of one generation's ID never generate at once, and one whose outcome is stored never runs.

Real redis-server and ``celery worker`` subprocesses; the copies are queued as a plain Celery client would
send them (the fleet's own producer refuses a second body under one ID, but nothing stops another sender).
On the old code both copies of a generation ran into one stream: its reader saw one generation's tokens
while the stored result was the other's; a copy sent after the outcome was stored ran again.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from producer.client import FleetClient, RequestStatus
from protocol.keys import DEAD_LETTER_KEY, RESULT_KEY, RUN_KEY, STREAM_KEY, WORKER_KEY_PREFIX
from protocol.messages import InferenceResult
from protocol.streams import StreamEvent, decode_events
from tests.integration.fleet_fixtures import Fleet
from tests.integration.ops_fixtures import scrape
from tests.queue_items import envelope, good_body, raw
from tools.build_llama import build_llama
from tools.processes import poll_until
from tools.redis_server import EmbeddedRedis, free_port

QUEUE = "fleet.demo-lm"
TOKENS = 300
LONG_TOKENS = 1000
ENDLESS_TOKENS = 20_000
"""Tokens a generation asks for that runs until it is cancelled (tens of seconds of decoding at least)."""


def _generation(seed: int, new: int = TOKENS) -> dict[str, Any]:
    """A sampled generation: two seeds give two different token sequences."""
    return {"model": "demo-lm", "input_ids": [5, 6, 7],
            "output": {"kind": "generate", "generation": {"max_new_tokens": new, "ignore_eos": True,
                                                          "temperature": 1.0, "seed": seed}}}  # fmt: skip


def _send(r: redis.Redis[bytes], request_id: str, request: dict[str, Any]) -> None:
    """Queue ``request`` under task ID ``request_id`` as a plain Celery client's ``fleet.infer`` message."""
    r.lpush(QUEUE, raw(envelope(QUEUE, good_body(request), task_id=request_id)))


def _count(log: Path | None, pattern: str) -> int:
    return len(re.findall(pattern, log.read_text(errors="replace") if log is not None and log.exists() else ""))


def _wait(what: str, ok: Callable[[], bool], tail: Callable[[], str], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s; worker log: {tail()}"
        time.sleep(0.05)


def _streamed(client: FleetClient, request_id: str) -> tuple[list[int], StreamEvent]:
    """The token IDs a reader of ``request_id``'s stream sees, and the event that ended it."""
    events = list(client.stream(request_id, timeout_s=120))
    return [e.token_id for e in events if e.type == "token" and e.token_id is not None], events[-1]


def _indexes_written(r: redis.Redis[bytes], request_id: str) -> list[int]:
    """The index of every token event in the stream key, in the order written (one generation: 0, 1, 2 …)."""
    return [event.index for _, fields in r.xrange(STREAM_KEY.format(id=request_id))
            for event in decode_events(fields) if event.type == "token"]  # fmt: skip


def test_two_copies_sent_at_once_generate_once_and_the_stream_is_the_stored_result(fleet: Fleet) -> None:
    cfg = fleet.config(models={"demo-lm": {"limits": {"max_new_tokens": 480}}}, worker={"heartbeat_s": 0.2})
    worker = fleet.worker(cfg)
    client = fleet.client(cfg)
    r = redis.Redis.from_url(fleet.redis_url)
    _send(r, "twice-1", _generation(seed=1))
    _send(r, "twice-1", _generation(seed=2))  # another body under the same ID

    tokens, end = _streamed(client, "twice-1")
    result = client.result("twice-1", wait=True, timeout_s=60)
    assert isinstance(result, InferenceResult) and result.generation is not None
    assert end.type == "final" and tokens == result.generation.token_ids  # a reader saw what was stored
    _wait("both copies acked", lambda: r.hlen("unacked") == 0 and r.llen(QUEUE) == 0, worker.log_tail)
    assert _indexes_written(r, "twice-1") == list(range(TOKENS))  # one generation wrote the stream, once
    assert _count(worker.log_path, r"Task fleet\.infer\[twice-1\] received") == 2
    assert _count(worker.log_path, r"Task fleet\.infer\[twice-1\] succeeded") == 1, worker.log_tail()
    assert _count(worker.log_path, r"generation twice-1 is already running") == 1, worker.log_tail()
    assert r.exists(RUN_KEY.format(id="twice-1"))
    assert worker.proc is not None and worker.proc.poll() is None


def test_a_copy_of_a_stored_generation_runs_nothing_and_changes_nothing(fleet: Fleet) -> None:
    port = free_port()
    cfg = fleet.config(models={"demo-lm": {"limits": {"max_new_tokens": 480}}}, worker={"metrics_port": port})
    worker = fleet.worker(cfg)
    client = fleet.client(cfg)
    r = redis.Redis.from_url(fleet.redis_url)
    _send(r, "again-1", _generation(seed=1))
    tokens, end = _streamed(client, "again-1")
    stored = r.get(RESULT_KEY.format(id="again-1"))
    stream_before = r.xrange(STREAM_KEY.format(id="again-1"))
    assert end.type == "final" and len(tokens) == TOKENS

    for seed in (1, 2):  # the same body (a redelivery), then another (a sender reusing the ID)
        _send(r, "again-1", _generation(seed=seed))
    _wait("both copies skipped", lambda: _count(worker.log_path, r"generation again-1 already has its outcome "
                                                                 r"stored \(SUCCESS\)") == 2, worker.log_tail)
    _wait("both copies acked", lambda: r.hlen("unacked") == 0 and r.llen(QUEUE) == 0, worker.log_tail)
    assert r.get(RESULT_KEY.format(id="again-1")) == stored
    assert r.xrange(STREAM_KEY.format(id="again-1")) == stream_before  # nothing written after the end
    assert _count(worker.log_path, r"Task fleet\.infer\[again-1\] succeeded") == 1
    copies = scrape(f"http://127.0.0.1:{port}/metrics")
    assert {outcome: copies[("fleet_worker_generation_copies_total", (("model", "demo-lm"), ("outcome", outcome)))]
            for outcome in ("skipped", "waited", "took_over")} == {"skipped": 2, "waited": 0, "took_over": 0}
    assert copies[("fleet_worker_requests_total", (("model", "demo-lm"), ("outcome", "succeeded")))] == 1


@pytest.fixture(scope="module")
def slow_decoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A deeper, wider decoder: :data:`LONG_TOKENS` take seconds on any machine, so a kill lands mid-generation."""
    return build_llama(tmp_path_factory.mktemp("slow-decoder"), hidden_size=256, num_layers=6,
                       max_positions=LONG_TOKENS + 64)  # fmt: skip


def test_a_waiting_copy_runs_the_generation_once_its_holder_dies_without_an_outcome(
    fleet: Fleet, slow_decoder: Path
) -> None:
    """Two workers of one token each: the holder generates, is stopped (SIGSTOP) after its first tokens, and the
    other takes the copy and waits on the holder's claim; the holder is SIGKILLed, its claim lapses (three
    heartbeats of 1 s) and the waiting copy runs the generation: one result, from the other worker. The holder's
    own message, restored after the visibility timeout, finds it stored and runs nothing."""
    cfg = fleet.config(visibility_timeout_s=4, worker={"heartbeat_s": 1.0},
                       models={"demo-lm": {"path": str(slow_decoder), "batching": {"max_batch_size": 1},
                                          "limits": {"max_new_tokens": LONG_TOKENS}}})
    workers = [fleet.worker(cfg, concurrency=1), fleet.worker(cfg, concurrency=1)]
    client = fleet.client(cfg)
    r = redis.Redis.from_url(fleet.redis_url)
    request = _generation(seed=3, new=LONG_TOKENS)
    _send(r, "orphan-1", request)
    for event in client.stream("orphan-1", timeout_s=60):  # its first tokens are out: one worker runs it
        if event.index >= 1:
            break
    holder_name = (r.get(RUN_KEY.format(id="orphan-1")) or b"").decode().partition(" ")[2]
    holder = next(w for w in workers if w.hostname == holder_name)
    other = next(w for w in workers if w is not holder)
    assert holder.proc is not None
    os.killpg(holder.proc.pid, signal.SIGSTOP)  # mid-generation, for good: its claim is renewed no more
    _send(r, "orphan-1", request)  # the holder's one token is taken: the other worker takes this copy
    _wait("the copy waiting", lambda: _count(other.log_path, r"generation orphan-1 is already running") == 1,
          other.log_tail)
    holder.kill()

    result = client.result("orphan-1", wait=True, timeout_s=120)
    assert isinstance(result, InferenceResult) and result.generation is not None
    assert result.timings.worker == other.hostname and len(result.generation.token_ids) == LONG_TOKENS
    assert _count(other.log_path, r"generation orphan-1: the claim of .* lapsed without an outcome") == 1
    tokens, end = _streamed(client, "orphan-1")
    assert end.type == "final" and tokens == result.generation.token_ids
    stored = r.get(RESULT_KEY.format(id="orphan-1"))
    # the dead holder's message comes back, as kombu's visibility-timeout restore puts it back (restore_by_tag;
    # kombu's own periodic scan waits for a lock a worker SIGKILLed inside it holds for 300 s): it finds the
    # outcome and runs nothing (so may the copy's own, held past the 4 s visibility timeout while it waited)
    _restore_unacked(fleet.redis_url)
    _wait("the holder's message restored and acked", lambda: _count(
        other.log_path, r"generation orphan-1 already has its outcome stored") >= 1, other.log_tail)
    _wait("nothing left", lambda: r.hlen("unacked") == 0 and r.llen(QUEUE) == 0, other.log_tail)
    assert r.get(RESULT_KEY.format(id="orphan-1")) == stored
    assert _count(other.log_path, r"Task fleet\.infer\[orphan-1\] succeeded") == 1


def _restore_unacked(redis_url: str) -> None:
    """Put every unacked message back on its queue, as kombu's visibility-timeout restore does."""
    app = Celery("restore", broker=redis_url)
    try:
        with app.connection_for_read() as conn:
            qos = conn.default_channel.qos
            for tag in redis.Redis.from_url(redis_url).hkeys("unacked"):
                qos.restore_by_tag(tag.decode())
    finally:
        app.close()


def _heartbeat(r: redis.Redis[bytes], hostname: str) -> dict[str, Any]:
    """The worker's last heartbeat document ({} when none is published, or Redis does not answer)."""
    raw = _get(r, WORKER_KEY_PREFIX + hostname)
    return dict(json.loads(raw)) if raw else {}


def _beat_of(r: redis.Redis[bytes], hostname: str) -> float:
    """The worker's last heartbeat time (0 when none is published, or Redis does not answer)."""
    return float(_heartbeat(r, hostname).get("heartbeat_unix_s", 0.0))


def _next_beat(r: redis.Redis[bytes], worker: Any) -> None:
    """Wait for ``worker``'s next heartbeat."""
    beat = _beat_of(r, worker.hostname)
    _wait(f"a heartbeat of {worker.hostname}", lambda: _beat_of(r, worker.hostname) > beat, worker.log_tail)


def _holder_and_other(r: redis.Redis[bytes], workers: list[Any], request_id: str) -> tuple[Any, Any]:
    holder_name = (r.get(RUN_KEY.format(id=request_id)) or b"").decode().partition(" ")[2]
    holder = next(w for w in workers if w.hostname == holder_name)
    return holder, next(w for w in workers if w is not holder)


@pytest.fixture(scope="module")
def endless_decoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The slow decoder with room for :data:`ENDLESS_TOKENS`: a generation that runs until it is cancelled."""
    return build_llama(tmp_path_factory.mktemp("endless-decoder"), hidden_size=256, num_layers=6,
                       max_positions=ENDLESS_TOKENS + 64)  # fmt: skip


def _endless_on_one_of_two(fleet: Fleet, cfg: Path, r: redis.Redis[bytes], request_id: str,
                           seed: int) -> tuple[FleetClient, Any, Any, dict[str, Any]]:
    """Two workers of one token each; an endless generation under ``request_id`` runs on one (its first tokens
    out). Returns a client, the holder, the other worker and the request sent."""
    workers = [fleet.worker(cfg, concurrency=1), fleet.worker(cfg, concurrency=1)]
    client = fleet.client(cfg)
    request = _generation(seed=seed, new=ENDLESS_TOKENS)
    _send(r, request_id, request)
    for event in client.stream(request_id, timeout_s=60):
        if event.index >= 1:
            break
    holder, other = _holder_and_other(r, workers, request_id)
    return client, holder, other, request


def _running_with_a_waiting_copy(fleet: Fleet, cfg: Path, r: redis.Redis[bytes], request_id: str,
                                 seed: int) -> tuple[FleetClient, Any, Any]:
    """:func:`_endless_on_one_of_two`, and a copy of the generation waiting on the other worker."""
    client, holder, other, request = _endless_on_one_of_two(fleet, cfg, r, request_id, seed)
    _send(r, request_id, request)  # the holder's one token is taken: the other worker takes this copy
    _wait("the copy waiting", lambda: _count(other.log_path, rf"generation {request_id} is already running") == 1,
          other.log_tail)
    return client, holder, other


def test_a_copy_waiting_through_a_redis_restart_never_runs_beside_its_live_holder(
    fleet: Fleet, redis_server: EmbeddedRedis, endless_decoder: Path
) -> None:
    """Redis restarts without persistence while one worker generates and the other holds a copy of the ID: the
    claim is gone, but its holder lives and writes it back at its next heartbeat (one every 2 s), so the copy
    runs nothing; the generation is then cancelled and the copy is acked once its outcome is stored. Before, the
    copy found the ID unclaimed at its next poll (every 0.5 s), took it and generated beside the holder into
    the same stream."""
    cfg = fleet.config(worker={"heartbeat_s": 2.0},
                       models={"demo-lm": {"path": str(endless_decoder), "batching": {"max_batch_size": 1},
                                          "limits": {"max_new_tokens": ENDLESS_TOKENS}}})  # fmt: skip
    r = redis.Redis(port=redis_server.port)
    client, holder, other = _running_with_a_waiting_copy(fleet, cfg, r, "restart-1", seed=4)
    _next_beat(r, holder)  # the holder's next beat is a whole period away
    redis_server.kill()
    redis_server.start()  # same port, empty: the claim, the STARTED state and the stream are gone

    run_key = RUN_KEY.format(id="restart-1")
    owner = poll_until(lambda: _get(r, run_key), 60, "the ID claimed again").decode()
    assert owner.partition(" ")[2] == holder.hostname, (owner, other.log_tail())  # written back by its holder
    poll_until(lambda: _status(client, "restart-1") is RequestStatus.RUNNING, 60, "the generation known again")
    assert client.cancel("restart-1")
    result = client.result("restart-1", wait=True, timeout_s=120)
    assert isinstance(result, InferenceResult) and result.generation is not None
    assert result.generation.finish_reason == "cancelled" and result.timings.worker == holder.hostname
    _wait("the copy acked without running", lambda: _count(
        other.log_path, r"generation restart-1 already has its outcome stored \(SUCCESS\) after waiting") == 1,
        other.log_tail)  # fmt: skip
    assert _count(other.log_path, r"generation restart-1: the claim of .* lapsed") == 0, other.log_tail()
    assert _count(holder.log_path, r"its claim lapsed .* both run") == 0, holder.log_tail()
    written = _indexes_written(r, "restart-1")  # what the holder wrote after the restart, once each
    assert len(set(written)) == len(written), written


def _get(r: redis.Redis[bytes], key: str) -> bytes | None:
    """``GET key``; None while Redis does not answer (it restarts)."""
    try:
        return r.get(key)
    except redis.RedisError:
        return None


def _status(client: FleetClient, request_id: str) -> RequestStatus | None:
    """The request's status; None while Redis does not answer (it restarts)."""
    try:
        return client.status(request_id)
    except redis.RedisError:
        return None


def test_a_copy_waiting_on_its_own_worker_s_generation_leaves_that_generation_in_readiness(
    fleet: Fleet, endless_decoder: Path
) -> None:
    """Both copies on one worker: the waiting one is left out of what the heartbeat counts as held (readiness,
    overdue slots), the running one is not. Before, the waiting copy's ID hid the running generation too: the
    worker reported 0 requests held while it generated."""
    cfg = fleet.config(models={"demo-lm": {"path": str(endless_decoder), "batching": {"max_batch_size": 1},
                                           "limits": {"max_new_tokens": ENDLESS_TOKENS}}})  # fmt: skip
    worker = fleet.worker(cfg, concurrency=2)
    client = fleet.client(cfg)
    r = redis.Redis.from_url(fleet.redis_url)
    request = _generation(seed=5, new=ENDLESS_TOKENS)
    _send(r, "own-1", request)
    for event in client.stream("own-1", timeout_s=60):
        if event.index >= 1:
            break
    _send(r, "own-1", request)
    _wait("the copy waiting", lambda: _count(worker.log_path, r"generation own-1 is already running") == 1,
          worker.log_tail)
    for _ in range(2):  # the first beat may have sampled before the copy was taken
        _next_beat(r, worker)
    doc = _heartbeat(r, worker.hostname)
    assert doc["generating"] == 1 and doc["held"] == 1, doc  # the running generation; the waiting copy left out
    assert client.cancel("own-1")
    result = client.result("own-1", wait=True, timeout_s=120)
    assert isinstance(result, InferenceResult) and result.generation is not None
    assert result.generation.finish_reason == "cancelled"
    _wait("the copy acked without running", lambda: _count(
        worker.log_path, r"generation own-1 already has its outcome stored \(SUCCESS\) after waiting") == 1,
        worker.log_tail)  # fmt: skip


def test_a_generation_restored_while_its_holder_runs_it_is_not_dead_lettered(
    fleet: Fleet, redis_server: EmbeddedRedis, endless_decoder: Path
) -> None:
    """A running generation's message is restored while its holder lives (as kombu's visibility-timeout restore
    does: the holder's beats renew its visibility, but a beat late past the timeout, or a channel with a
    ``global_keyprefix``, where they cannot, lets it happen), and with ``max_deliveries: 1`` that restored copy
    is over the limit. Its holder is alive (its claim renewed), so the copy is no poison: it waits for the
    outcome and is acked without running, and the generation's own result is the one stored. Before, the copy
    was dead-lettered and its FAILURE (``max_deliveries``) stored under the ID while the holder generated on;
    the holder's result was then refused."""
    cfg = fleet.config(worker={"heartbeat_s": 1.0, "max_deliveries": 1},
                       models={"demo-lm": {"path": str(endless_decoder), "batching": {"max_batch_size": 1},
                                          "limits": {"max_new_tokens": ENDLESS_TOKENS}}})  # fmt: skip
    r = redis.Redis(port=redis_server.port)
    client, holder, other, _ = _endless_on_one_of_two(fleet, cfg, r, "outlived-1", seed=5)
    _restore_unacked(fleet.redis_url)
    # the restored copy reaches the other worker (the holder's one token is taken): waiting, or (before) refused
    _wait("the restored copy delivered", lambda: _count(other.log_path, r"generation outlived-1 is already running")
          + r.llen(DEAD_LETTER_KEY) >= 1, other.log_tail)  # fmt: skip
    assert r.llen(DEAD_LETTER_KEY) == 0, r.lrange(DEAD_LETTER_KEY, 0, -1)
    assert _status(client, "outlived-1") is RequestStatus.RUNNING
    assert client.cancel("outlived-1")
    result = client.result("outlived-1", wait=True, timeout_s=120)
    assert isinstance(result, InferenceResult) and result.generation is not None
    assert result.generation.finish_reason == "cancelled" and result.timings.worker == holder.hostname
    _wait("the copy acked without running", lambda: _count(
        other.log_path, r"generation outlived-1 already has its outcome stored \(SUCCESS\) after waiting") >= 1,
        other.log_tail)  # fmt: skip
    assert r.llen(DEAD_LETTER_KEY) == 0


def test_a_warm_shutdown_puts_a_waiting_copy_back_instead_of_waiting_for_the_generation(
    fleet: Fleet, redis_server: EmbeddedRedis, endless_decoder: Path
) -> None:
    """A worker holding a copy of a generation another worker runs gets SIGTERM: it stops at once, the copy back
    in the queue, and a worker started later acks it without running once the outcome is stored. Before, the
    warm shutdown waited for the other worker's generation to end (here it never does: SIGKILL after 60 s)."""
    cfg = fleet.config(models={"demo-lm": {"path": str(endless_decoder), "batching": {"max_batch_size": 1},
                                          "limits": {"max_new_tokens": ENDLESS_TOKENS}}})  # fmt: skip
    r = redis.Redis(port=redis_server.port)
    client, holder, other = _running_with_a_waiting_copy(fleet, cfg, r, "shutdown-1", seed=6)
    assert other.stop(timeout_s=60) == 0, other.log_tail()  # a warm shutdown that ended by itself
    assert _count(other.log_path, r"generation shutdown-1: this worker is shutting down") == 1
    assert r.llen(QUEUE) == 1 and r.hlen("unacked") == 1  # the copy queued again; the holder's own, held
    assert client.cancel("shutdown-1")
    result = client.result("shutdown-1", wait=True, timeout_s=120)
    assert isinstance(result, InferenceResult) and result.timings.worker == holder.hostname
    later = fleet.worker(cfg, concurrency=1)  # the copy goes to it or to the holder, free again
    skipped = r"generation shutdown-1 already has its outcome stored \(SUCCESS\)"
    _wait("the copy acked without running", lambda: _count(later.log_path, skipped) + _count(holder.log_path, skipped)
          == 1, later.log_tail)  # fmt: skip
    _wait("nothing left", lambda: r.hlen("unacked") == 0 and r.llen(QUEUE) == 0, later.log_tail)


def test_a_generation_held_past_the_visibility_timeout_is_not_delivered_again_while_its_worker_lives(
    fleet: Fleet, redis_server: EmbeddedRedis, endless_decoder: Path
) -> None:
    """A generation runs for three visibility timeouts (3 s each) on a live worker: each heartbeat renews its
    message's visibility, so kombu's restore (every second, on both workers) never puts it back, and no copy of
    it is delivered. Before, it came back once per timeout: a copy on the other worker waited for it, holding
    that worker's one token, and the next came back from that copy in turn."""
    cfg = fleet.config(visibility_timeout_s=3, worker={"heartbeat_s": 0.5},
                       models={"demo-lm": {"path": str(endless_decoder), "batching": {"max_batch_size": 1},
                                          "limits": {"max_new_tokens": ENDLESS_TOKENS}}})  # fmt: skip
    r = redis.Redis(port=redis_server.port)
    client, holder, other, _ = _endless_on_one_of_two(fleet, cfg, r, "long-1", seed=7)
    (tag,) = r.hkeys("unacked")
    taken_at = r.zscore("unacked_index", tag) or 0.0
    _wait("three visibility timeouts after the take", lambda: time.time() > taken_at + 3 * 3, holder.log_tail)
    assert _count(other.log_path, r"Task fleet\.infer\[long-1\] received") == 0, other.log_tail()
    assert r.hkeys("unacked") == [tag] and r.llen(QUEUE) == 0
    assert (r.zscore("unacked_index", tag) or 0.0) > taken_at + 3  # renewed by the holder's beats
    assert _status(client, "long-1") is RequestStatus.RUNNING
    assert client.cancel("long-1")
    result = client.result("long-1", wait=True, timeout_s=120)
    assert isinstance(result, InferenceResult) and result.timings.worker == holder.hostname
    _wait("nothing left", lambda: r.hlen("unacked") == 0 and r.llen(QUEUE) == 0, holder.log_tail)
    assert _count(holder.log_path, r"Task fleet\.infer\[long-1\] received") == 1
    assert _count(other.log_path, r"Task fleet\.infer\[long-1\] received") == 0
