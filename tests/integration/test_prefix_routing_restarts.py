"""Nothing waits forever in a worker's own queue that no worker takes from (real ``celery worker`` processes).

Reported: two workers with prefix-aware routing; the one holding a prefix was SIGKILLed and restarted under
the same name with the prefix cache off (so it no longer consumes a queue of its own). Its predecessor's
prefix-digest set lived on for its TTL, so producers kept sending generations with that prefix to the name's
own queue; the new process never registered as consuming it, the other worker stopped rescuing it once the
predecessor's registration lingered out, and the generations stayed ``queued`` until a worker with the cache
on came back. Now a worker takes over its name's leftovers at start, a worker that does not consume its own
queue empties it every beat and rescues dead workers' queues, and producers route only to workers registered
as consuming their own queue (:mod:`workers.direct_queue`, :mod:`producer.prefix_routing`); ``fleet status``
counts what waits in workers' own queues.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import redis

from producer.client import FleetClient
from producer.ops_cli import format_status, status_document
from protocol.keys import DIRECT_QUEUES_KEY, PREFIX_HOLDER_KEY, WORKER_KEY_PREFIX
from protocol.messages import InferenceResult
from protocol.prefix_digest import block_digests
from tests.integration.fleet_fixtures import Fleet
from tools.processes import poll_until

MODEL = "demo-llama"
BLOCK = 4
PREFIX = list(range(3, 23))  # five whole blocks
pytestmark = pytest.mark.slow


def _config(fleet: Fleet, *, prefix_cache_bytes: int | None = None) -> Path:
    batching: dict[str, int] = {"prefix_block_tokens": BLOCK}
    if prefix_cache_bytes is not None:
        batching["prefix_cache_bytes"] = prefix_cache_bytes
    # visibility timeout 6 s: a dead worker's queue is watched (rescued) for 6 + 1 + 2 x 2 s past its expiry
    return fleet.config(worker={"model": MODEL, "heartbeat_s": 0.5}, visibility_timeout_s=6,
                        models={MODEL: {"batching": batching, "routing": {"max_direct_queued": 64},
                                        "limits": {"max_input_tokens": 256, "max_new_tokens": 256}}})  # fmt: skip


def _generate(client: FleetClient, prompt: list[int]) -> str:
    return client.submit(MODEL, prompt, generation={"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})


def _held_by(r: redis.Redis[bytes], host: str, tokens: list[int]) -> bool:
    digests = block_digests(tokens[:-1], BLOCK)
    return bool(digests) and bool(r.sismember(PREFIX_HOLDER_KEY.format(model=MODEL, host=host), digests[-1]))


def _served(client: FleetClient, ids: list[str], timeout_s: float) -> list[InferenceResult]:
    results = client.wait(ids, timeout_s=timeout_s)
    assert all(isinstance(res, InferenceResult) for res in results), results
    return [res for res in results if isinstance(res, InferenceResult)]


def test_a_holder_restarted_without_routing_under_its_name_gets_nothing_stranded(fleet: Fleet) -> None:
    cfg = _config(fleet)
    workers = [fleet.worker(cfg, MODEL), fleet.worker(cfg, MODEL)]
    client = fleet.client(cfg)
    r = client.redis
    first = _served(client, [_generate(client, [*PREFIX, 40])], 60)[0]
    holder = next(w for w in workers if w.hostname == first.timings.worker)
    assert _held_by(r, holder.hostname, [*PREFIX, 41])
    own_queue = client.settings.direct_queue_for(MODEL, holder.hostname)

    holder.kill()
    poll_until(lambda: not r.exists(WORKER_KEY_PREFIX + holder.hostname), 30, "the killed worker's heartbeat to expire")
    restarted = fleet.worker(_config(fleet, prefix_cache_bytes=0), MODEL, hostname=holder.hostname)
    assert r.get(WORKER_KEY_PREFIX + holder.hostname) is not None
    # the other worker rescues the name's queue while the predecessor's registration lingers; past that, only
    # the name's own process can (what the reporter waited ~15 s for)
    registry = DIRECT_QUEUES_KEY.format(model=MODEL)
    poll_until(lambda: r.zscore(registry, holder.hostname) is None, 60, "the predecessor's registration to go")

    router = client.router.prefixes
    chosen: list[str | None] = []
    pick = router.direct_queues

    def recorded(model: str, prompts: Sequence[Sequence[int]]) -> list[str | None]:
        queues = pick(model, prompts)
        chosen.extend(queues)
        return queues

    router.direct_queues = recorded  # type: ignore[method-assign]
    ids = [_generate(client, [*PREFIX, 50 + i]) for i in range(3)]
    results = _served(client, ids, 45)
    assert {res.timings.worker for res in results} <= {w.hostname for w in workers} | {restarted.hostname}
    assert r.llen(own_queue) == 0
    assert not r.exists(PREFIX_HOLDER_KEY.format(model=MODEL, host=holder.hostname))  # deleted at start
    # none went to the restarted name's own queue; one served by the other worker may route the next ones to
    # that worker, which now holds the prefix (when its result is stored before the next request is submitted)
    assert len(chosen) == 3 and own_queue not in chosen, chosen


def test_a_worker_that_does_not_consume_its_own_queue_empties_it_and_rescues_dead_workers_queues(
    fleet: Fleet,
) -> None:
    """The one worker of the model has its prefix cache off (routing setting changed on it alone): requests that
    reach its own queue (a producer that read a predecessor's registration) and the queue of a dead worker that
    consumed one (registered, past its expiry) are both moved to the model's queue and served."""
    worker = fleet.worker(_config(fleet, prefix_cache_bytes=0), MODEL)
    client = fleet.client(_config(fleet))
    r = client.redis
    ghost = "ghost@gone"
    r.zadd(DIRECT_QUEUES_KEY.format(model=MODEL), {ghost: time.time() - 1})
    targets = [client.settings.direct_queue_for(MODEL, worker.hostname), client.settings.direct_queue_for(MODEL, ghost)]
    chosen = iter(targets)
    client.router.prefixes.direct_queues = lambda model, prompts: [next(chosen) for _ in prompts]  # type: ignore[method-assign]
    ids = [_generate(client, [*PREFIX, 60 + i]) for i in range(len(targets))]
    results = _served(client, ids, 45)
    assert {res.timings.worker for res in results} == {worker.hostname}
    assert [r.llen(q) for q in targets] == [0, 0]


def test_fleet_status_counts_what_waits_in_workers_own_queues(fleet: Fleet) -> None:
    """Before, ``fleet status`` showed depth 0 for a model whose requests waited in a worker's own queue."""
    settings = fleet.settings(_config(fleet))
    r: redis.Redis[bytes] = redis.Redis.from_url(fleet.redis_url)
    r.zadd(DIRECT_QUEUES_KEY.format(model=MODEL), {"a@x": time.time() + 600, "dead@y": time.time() - 1})
    r.lpush(settings.direct_queue_for(MODEL, "a@x"), b"1", b"2")
    r.lpush(settings.direct_queue_for(MODEL, "dead@y"), b"3")
    doc = status_document(settings, r)
    [row] = [q for q in doc["queues"] if q["model"] == MODEL]
    assert (row["depth"], row["direct_depth"]) == (0, 3)
    assert f"{MODEL}: 3 more waiting in workers' own queues" in format_status(doc)
