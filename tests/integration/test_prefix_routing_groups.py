"""Prefix-aware routing of generations sent together: one lookup round trip for the group, the same
choices as sent one by one, and ``routing.max_direct_queued`` bounding the group.

Against a real redis-server with two workers' published state written the way workers write it (live
set, own-queue registrations and prefix-digest sets; no worker process: the lookup is the producer's).
Before, a grouped send (``FleetClient.send_batch``, the gateway's submit groups) looked up every generation
in a round trip of its own, and a group routed every generation to a holder whose queue was below the bound, past it.
"""

from __future__ import annotations

import time

import redis

from bench.procs import redis_commandstats
from producer.prefix_routing import PrefixRouter
from protocol.keys import DIRECT_QUEUES_KEY, LIVE_WORKERS_KEY, PREFIX_HOLDER_KEY
from protocol.prefix_digest import block_digests
from protocol.settings import load_settings
from tests.integration.fleet_fixtures import Fleet

MODEL = "demo-llama"
BLOCK = 4
HOSTS = ("w1@a", "w2@b")


def _router(fleet: Fleet, max_direct_queued: int,
            hosts: tuple[str, ...] = HOSTS) -> tuple[PrefixRouter, redis.Redis[bytes]]:  # fmt: skip
    cfg = fleet.config(models={MODEL: {"batching": {"prefix_block_tokens": BLOCK},
                                       "routing": {"max_direct_queued": max_direct_queued}}})  # fmt: skip
    settings = load_settings(cfg)
    r: redis.Redis[bytes] = redis.Redis.from_url(fleet.redis_url)
    r.zadd(LIVE_WORKERS_KEY.format(model=MODEL), {h: time.time() + 600 for h in hosts})
    r.zadd(DIRECT_QUEUES_KEY.format(model=MODEL), {h: time.time() + 600 for h in hosts})  # they consume their own
    return PrefixRouter(r, settings), r


def _hold(r: redis.Redis[bytes], host: str, prompt: list[int]) -> None:
    r.sadd(PREFIX_HOLDER_KEY.format(model=MODEL, host=host), *block_digests(prompt, BLOCK))


def test_a_group_is_looked_up_in_one_round_trip_with_the_choices_of_single_sends(fleet: Fleet) -> None:
    router, r = _router(fleet, max_direct_queued=64)
    held_by_1, held_by_2 = list(range(3, 12)), list(range(40, 49))
    _hold(r, HOSTS[0], held_by_1)
    _hold(r, HOSTS[1], held_by_2)
    prompts = [[*held_by_1, 7], [*held_by_2, 8], list(range(90, 99)), [5, 6]]  # the last: no whole block
    alone = [router.direct_queue(MODEL, p) for p in prompts]
    before = redis_commandstats(fleet.redis_url)
    grouped = router.direct_queues(MODEL, prompts)
    calls = {k: v - before.get(k, 0) for k, v in redis_commandstats(fleet.redis_url).items()}
    settings = router.settings
    assert grouped == alone == [settings.direct_queue_for(MODEL, HOSTS[0]), settings.direct_queue_for(MODEL, HOSTS[1]),
                                None, None]  # fmt: skip
    # one pipeline: a membership test per looked-up prompt and worker, each worker's queue read once
    assert calls.get("smismember", 0) == 3 * len(HOSTS) and calls.get("llen", 0) == len(HOSTS)


def test_a_group_never_routes_past_max_direct_queued(fleet: Fleet) -> None:
    router, r = _router(fleet, max_direct_queued=3)
    held = list(range(3, 12))
    _hold(r, HOSTS[0], held)
    r.lpush(router.settings.direct_queue_for(MODEL, HOSTS[0]), b"waiting")  # one already waits there
    routed_before = router.routed
    grouped = router.direct_queues(MODEL, [[*held, 50 + i] for i in range(4)])
    own = router.settings.direct_queue_for(MODEL, HOSTS[0])
    assert grouped == [own, own, None, None]  # 1 waiting + 2 routed = the bound; the rest to the model's queue
    assert router.routed - routed_before == 2 and router.passed_over >= 2


def test_one_live_worker_is_not_looked_up_and_gets_its_requests_on_the_model_s_queue(fleet: Fleet) -> None:
    """A lone worker takes from the model's queue as well as its own: a lookup could only choose it, and an
    idle worker waits on the list it last took from, looking at the other every ``routing.direct_wait_ms``
    (traced: a turn routed to a lone idle worker's own queue started 27 ms after its submit). Before, every
    generation of a one-worker model paid the lookup's round trip and went to the worker's own queue."""
    router, r = _router(fleet, max_direct_queued=64, hosts=HOSTS[:1])
    held = list(range(3, 12))
    _hold(r, HOSTS[0], held)
    before = redis_commandstats(fleet.redis_url)
    chosen = router.direct_queues(MODEL, [[*held, 7], [*held, 8]])
    calls = {k: v - before.get(k, 0) for k, v in redis_commandstats(fleet.redis_url).items()}
    assert chosen == [None, None]  # the model's queue
    assert calls.get("smismember", 0) == 0 and calls.get("llen", 0) == 0, calls
    assert router.routed == 0
    r.zadd(LIVE_WORKERS_KEY.format(model=MODEL), {HOSTS[1]: time.time() + 600})  # a second worker goes live
    router.cache_s = 0.0
    own = router.settings.direct_queue_for(MODEL, HOSTS[0])
    assert router.direct_queues(MODEL, [[*held, 7]]) == [own]


def test_a_live_holder_that_does_not_consume_its_own_queue_is_never_routed_to(fleet: Fleet) -> None:
    """Its set says it holds the prompt (a SIGKILLed predecessor under its name published it, and the set lives
    for its TTL), but it is not registered as consuming its own queue, or its registration has expired: the
    model's queue. Before, the set alone decided, and the request waited in a queue nobody took from."""
    router, r = _router(fleet, max_direct_queued=64)
    held = list(range(3, 12))
    _hold(r, HOSTS[1], held)
    registry = DIRECT_QUEUES_KEY.format(model=MODEL)
    r.zrem(registry, HOSTS[1])  # live (its heartbeat), routing off in its config
    assert router.direct_queues(MODEL, [[*held, 7]]) == [None]
    r.zadd(registry, {HOSTS[1]: time.time() - 1})  # a predecessor's registration, expired
    router.cache_s = 0.0
    assert router.direct_queues(MODEL, [[*held, 7]]) == [None]
    assert router.routed == 0 and router.passed_over == 0
    r.zadd(registry, {HOSTS[1]: time.time() + 600})  # it consumes its own queue again
    assert router.direct_queues(MODEL, [[*held, 7]]) == [router.settings.direct_queue_for(MODEL, HOSTS[1])]
