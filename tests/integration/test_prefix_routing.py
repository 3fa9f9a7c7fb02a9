"""Prefix-aware routing on real workers: a conversation's next turn goes to the worker holding its prefix,
and a request routed to a worker that dies is served by another.

Two real ``celery worker`` processes serve the Llama-style demo decoder with the prefix cache and
routing on (4-token blocks). Each turn's prompt is the whole conversation so far plus a new message.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from producer.client import FleetClient
from protocol.keys import LIVE_WORKERS_KEY, PREFIX_HOLDER_KEY
from protocol.messages import InferenceResult
from protocol.prefix_digest import block_digests
from protocol.settings import load_settings
from tests.integration.fleet_fixtures import Fleet
from tests.integration.ops_fixtures import API_KEY, OpsFleet, ops_fleet, ops_models, ops_redis  # noqa: F401
from tools.build_llama import build_llama
from tools.ledger import Ledger

MODEL = "demo-llama"
BLOCK = 4
LONG_TURN_TOKENS = 1000
"""New tokens of the turn a worker is killed in the middle of."""
pytestmark = pytest.mark.slow


def _config(fleet: Fleet, *, heartbeat_s: float = 0.5, max_direct_queued: int = 4, path: Path | None = None,
            **extra: Any) -> Path:
    """The demo decoder with 4-token prefix blocks and routing on (``path``: another build of it)."""
    model: dict[str, Any] = {"batching": {"prefix_block_tokens": BLOCK},
                             "limits": {"max_input_tokens": 256, "max_new_tokens": LONG_TURN_TOKENS},
                             "routing": {"max_direct_queued": max_direct_queued}}  # fmt: skip
    if path is not None:  # the slow build: a conversation past the long turn fits it
        model["path"] = str(path)
        model["limits"]["max_input_tokens"] = LONG_TURN_TOKENS + 64
    return fleet.config(worker={"model": MODEL, "heartbeat_s": heartbeat_s}, models={MODEL: model}, **extra)


@pytest.fixture(scope="module")
def slow_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A deeper, wider demo decoder with room for a turn of :data:`LONG_TURN_TOKENS`: seconds of decoding on any
    machine, so a worker killed once the turn's first tokens are out is killed mid-turn."""
    return build_llama(tmp_path_factory.mktemp("slow-llama"), hidden_size=256, num_layers=6,
                       max_positions=LONG_TURN_TOKENS + 256)  # fmt: skip


def _generate(client: FleetClient, prompt: list[int], new: int = 6) -> str:
    return client.submit(MODEL, prompt, generation={"max_new_tokens": new, "temperature": 0, "ignore_eos": True})


def _held_by(r: redis.Redis[bytes], host: str, tokens: list[int]) -> bool:
    """True once ``host`` has published the deepest block digest of ``tokens`` (all but the last one)."""
    digests = block_digests(tokens[:-1], BLOCK)
    return bool(digests) and bool(r.sismember(PREFIX_HOLDER_KEY.format(model=MODEL, host=host), digests[-1]))


def test_each_turn_goes_to_the_worker_that_holds_its_conversation(fleet: Fleet) -> None:
    # a heartbeat TTL of 6 s: a worker starved by a loaded machine stays live (liveness is another test's
    # subject), and no busy bound: all six conversations may hold one worker, whose queue then briefly
    # holds six turns (the bound is pick_holder's unit test)
    cfg = _config(fleet, heartbeat_s=2.0, max_direct_queued=64)
    workers = [fleet.worker(cfg, MODEL), fleet.worker(cfg, MODEL)]
    client = fleet.client(cfg)
    rng = random.Random(3)
    conversations = 6
    history: list[list[int]] = [[] for _ in range(conversations)]
    served_by: list[list[str]] = [[] for _ in range(conversations)]
    for turn in range(4):
        prompts = [h + [rng.randrange(3, 500) for _ in range(rng.randint(5, 10))] for h in history]
        if turn:  # each conversation is held by the time its reply is stored (PrefixHolder.sync), not eventually
            for host, tokens in zip([hosts[-1] for hosts in served_by], history, strict=True):
                assert _held_by(client.redis, host, tokens), f"worker {host} had not published the prefix"
        ids = [_generate(client, p) for p in prompts]
        results = client.wait(ids, timeout_s=120)
        for c, (prompt, res) in enumerate(zip(prompts, results, strict=True)):
            assert isinstance(res, InferenceResult) and res.generation is not None, res
            history[c] = prompt + res.generation.token_ids
            served_by[c].append(res.timings.worker)
    for c, hosts in enumerate(served_by):
        assert len(set(hosts)) == 1, f"conversation {c} moved between workers: {hosts}"
    assert client.router.prefixes.routed == conversations * 3
    assert {w.hostname for w in workers} >= {hosts[0] for hosts in served_by}


def test_a_burst_split_between_the_worker_s_own_queue_and_the_model_s_starts_together(fleet: Fleet) -> None:
    """Sixteen generations queued in one Redis step: the eight whose prefix the worker holds are routed to
    its own queue, the eight new ones to the model's. The worker takes both lists in one take, so all
    sixteen start in the same step (``start_together_ms`` holds the first for what the worker took).
    Before, a take read one list only and the next turn waited on the emptied list
    (``routing.direct_wait_ms``) while the other held the rest: the first eight started alone and the
    others joined steps later (batch_size_min 8)."""
    cfg = fleet.config(
        worker={"model": MODEL, "heartbeat_s": 2.0, "concurrency": 16},
        models={MODEL: {"batching": {"prefix_block_tokens": BLOCK, "max_batch_size": 16, "start_together_ms": 10_000},
                        "limits": {"max_input_tokens": 256, "max_new_tokens": 256},
                        "routing": {"max_direct_queued": 64}}},
    )
    worker = fleet.worker(cfg, MODEL, concurrency=16)
    client = fleet.client(cfg)
    # a second live worker that holds nothing (its heartbeat's entry): with one live worker no lookup is made
    client.redis.zadd(LIVE_WORKERS_KEY.format(model=MODEL), {"idle@elsewhere": time.time() + 600})
    params = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True, "stream": False}
    known = [[3 + 20 * i + k for k in range(9)] for i in range(8)]  # two whole blocks each, distinct
    first = client.wait(client.send_batch([client.build_request(MODEL, p, generation=params) for p in known]),
                        timeout_s=120)
    for prompt, res in zip(known, first, strict=True):
        assert isinstance(res, InferenceResult) and res.generation is not None, res
        assert _held_by(client.redis, worker.hostname, prompt + res.generation.token_ids)  # held before stored
    own_queue = client.settings.direct_queue_for(MODEL, worker.hostname)
    fresh = [[400 + 9 * i + k for k in range(9)] for i in range(8)]
    routed_before = client.router.prefixes.routed
    burst = [client.build_request(MODEL, [*p, 300], generation=params) for p in known]
    burst += [client.build_request(MODEL, p, generation=params) for p in fresh]
    results = client.wait(client.send_batch(burst), timeout_s=120)
    assert client.router.prefixes.routed - routed_before == 8, "the known prompts were not routed to the worker"
    assert client.redis.llen(own_queue) == 0
    detail = [(r.generation.timings.batch_size_min, r.generation.timings.decode_steps)  # type: ignore[union-attr]
              for r in results if isinstance(r, InferenceResult)]
    assert [size for size, _ in detail] == [16] * 16, detail


def test_a_turn_routed_to_a_worker_that_dies_is_served_by_another(fleet: Fleet, slow_llama: Path) -> None:
    """Two cases on the conversation's holder: SIGKILLed while it runs the turn (the turn comes back after
    the visibility timeout, into the dead worker's queue, and is moved), and SIGKILLed with the turn still
    waiting in its queue (moved once its heartbeat expires). Each turn: one result, from the other worker;
    nothing left queued or unacked."""
    cfg = _config(fleet, visibility_timeout_s=6, path=slow_llama)
    first, second = fleet.worker(cfg, MODEL), fleet.worker(cfg, MODEL)
    client = fleet.client(cfg)
    r = client.redis
    by_host = {first.hostname: first, second.hostname: second}
    queues = [client.settings.queue_for(MODEL), *(client.settings.direct_queue_for(MODEL, h) for h in by_host)]
    ledger = Ledger(r, queues=queues)

    prompt = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    turn1 = client.wait([_generate(client, prompt)], timeout_s=60)[0]
    assert isinstance(turn1, InferenceResult) and turn1.generation is not None
    holder = by_host[turn1.timings.worker]
    other = second if holder is first else first
    history = prompt + turn1.generation.token_ids
    assert _held_by(r, holder.hostname, history)  # held by the time the reply is stored

    long_turn = _generate(client, [*history, 20, 21, 22], new=LONG_TURN_TOKENS)  # killed mid-turn
    ledger.accepted(long_turn)
    for event in client.stream(long_turn, timeout_s=60):  # its first tokens are out: the holder runs it
        if event.index >= 1:
            break
    killed_at = time.monotonic()
    holder.kill()
    done = client.wait([long_turn], timeout_s=90)[0]
    mid_turn_s = time.monotonic() - killed_at
    assert isinstance(done, InferenceResult) and done.timings.worker == other.hostname, done

    # the other worker holds the conversation now; kill it with a turn waiting in its own queue
    assert done.generation is not None
    history2 = [*history, 20, 21, 22, *done.generation.token_ids]
    assert _held_by(r, other.hostname, history2)
    third = fleet.worker(cfg, MODEL)
    other.kill()
    killed_at = time.monotonic()
    queued_turn = _generate(client, [*history2, 30, 31])  # routed to the dead worker's queue (still live)
    ledger.accepted(queued_turn)
    done2 = client.wait([queued_turn], timeout_s=60)[0]
    queued_s = time.monotonic() - killed_at
    assert isinstance(done2, InferenceResult) and done2.timings.worker == third.hostname, done2
    assert client.router.prefixes.routed >= 2

    report = ledger.check_settled(30)
    assert report.ok, report
    print(f"\nkilled mid-turn: served by the other worker {mid_turn_s:.1f} s after the kill "
          f"(visibility timeout 6 s); killed with the turn queued: {queued_s:.1f} s (heartbeat TTL 2 s)")


def test_a_responses_conversation_through_the_gateway_stays_on_its_worker(ops_fleet: OpsFleet) -> None:  # noqa: F811
    """The official SDK continues a conversation with ``previous_response_id``: every turn after the first is
    routed to the worker that served the one before (the prompt is the rendered history), and the gateway
    counts it in ``fleet_gateway_prefix_routing_total``. Each turn's ``usage`` says how much of its prompt came
    from the prefix cache (``input_tokens_details.cached_tokens``; ``prompt_tokens_details`` on chat)."""
    config = ops_fleet.config(serve=("demo-lm",), models={"demo-lm": {"limits": {"max_input_tokens": 480}}})
    ops_fleet.worker(config)
    ops_fleet.worker(config)
    gateway = ops_fleet.gateway(config)
    client = OpenAI(base_url=gateway.url + "/v1", api_key=API_KEY, max_retries=0)
    fleet = FleetClient(load_settings(config))
    try:
        instructions = "Answer in one short line."
        previous = None
        served_by, cached = [], []
        for turn in range(3):
            response = client.responses.create(model="demo-lm", instructions=instructions, input=f"Question {turn}?",
                                               previous_response_id=previous, max_output_tokens=8)  # fmt: skip
            previous = response.id
            result = fleet.result(response.id.removeprefix("resp_"), wait=True, timeout_s=30)
            assert result is not None and result.generation is not None and response.usage is not None
            served_by.append(result.timings.worker)
            cached.append(response.usage.input_tokens_details.cached_tokens)
            assert cached[-1] == result.generation.usage.cached_tokens < response.usage.input_tokens
            # the worker published this turn's prefix before it stored the reply the SDK got
            assert fleet.redis.scard(PREFIX_HOLDER_KEY.format(model="demo-lm", host=result.timings.worker))
        assert len(set(served_by)) == 1, served_by
        assert cached[0] == 0 and all(c > 0 for c in cached[1:]), cached  # later turns reuse the earlier turns' KV
        # the same chat twice: the second is routed to the first's worker and its prompt's KV is reused
        messages: list[Any] = [{"role": "user", "content": "Say something short about queues."}]
        first, again = (client.chat.completions.create(model="demo-lm", messages=messages, max_tokens=4, temperature=0)
                        for _ in range(2))  # fmt: skip
        assert first.usage is not None and again.usage is not None
        details = [u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else None
                   for u in (first.usage, again.usage)]  # fmt: skip
        assert details[0] is not None and details[0] < (details[1] or 0) < again.usage.prompt_tokens, details
        print(f"\ncached prompt tokens: responses turns {cached}, the same chat twice {details} "
              f"of {again.usage.prompt_tokens}")
        metrics = {(s.name, s.labels.get("result")): s.value
                   for family in text_string_to_metric_families(httpx.get(gateway.url + "/metrics").text)
                   for s in family.samples}  # fmt: skip
        assert metrics[("fleet_gateway_prefix_routing_total", "routed")] >= 2
    finally:
        fleet.close()
