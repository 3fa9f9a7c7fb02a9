"""Generation on real workers: continuous batching gives each request exactly its tokens alone,
seeded sampling survives batching and a SIGKILL redelivery, short requests overtake long ones,
cancels stop a running sequence, and streams carry the tokens as they are produced."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import redis

from producer.client import FleetClient, RequestStatus
from protocol.errors import InvalidRequest
from protocol.keys import STREAM_KEY
from protocol.messages import InferenceResult
from protocol.streams import StreamEvent, decode_events
from tests.integration.fleet_fixtures import Fleet
from tests.integration.redis_monitor import Monitor
from tests.integration.stream_order import Throttled, asked_past_first, ended, relayed_before_stored
from tests.integration.test_generation_adversary_worker import ENDLESS_TOKENS, endless_decoder
from tools.processes import poll_until
from tools.redis_server import free_port

__all__ = ["endless_decoder"]  # a fixture shared with test_generation_adversary_worker

MODEL = "demo-lm"


def _generate(client: FleetClient, prompt: list[int], model: str = MODEL, **params: Any) -> str:
    return client.submit(model, prompt, generation=params)


def _result(client: FleetClient, rid: str, timeout_s: float = 120) -> InferenceResult:
    result = client.result(rid, wait=True, timeout_s=timeout_s)
    assert result is not None and result.generation is not None
    return result


def _workload(seed: int, count: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, 259) for _ in range(rng.randint(1, 60))], rng.randint(1, 48)) for _ in range(count)]


def _alone_then_together(
    fleet: Fleet, params: dict[str, Any], model: str = MODEL
) -> tuple[list[InferenceResult], list[InferenceResult]]:
    cfg = fleet.config(worker={"model": model}, models={model: {"batching": {"max_batch_size": 8}}})
    fleet.worker(cfg, model=model, concurrency=8)
    client = fleet.client(cfg)
    work = _workload(7, 16)
    alone = [
        _result(client, _generate(client, prompt, model, max_new_tokens=n, seed=i, **params))
        for i, (prompt, n) in enumerate(work)
    ]
    rng = random.Random(1)
    half = len(work) // 2
    # a burst queued in one Redis step (the worker takes it in one take: they share steps), then arrivals at
    # random times mid-run. A burst of single submits shares steps only as far as the machine's timing lets
    # the worker see the next one coming.
    ids = client.send_batch([client.build_request(model, prompt, generation={"max_new_tokens": n, "seed": i, **params})
                             for i, (prompt, n) in enumerate(work[:half])])  # fmt: skip
    for i, (prompt, n) in enumerate(work[half:], start=half):
        ids.append(_generate(client, prompt, model, max_new_tokens=n, seed=i, **params))
        time.sleep(rng.random() * 0.004)
    together = [_result(client, rid) for rid in ids]
    return alone, together


@pytest.mark.parametrize("model", ["demo-lm", "demo-llama"])
def test_greedy_continuous_batching_gives_each_request_its_tokens_alone(fleet: Fleet, model: str) -> None:
    alone, together = _alone_then_together(fleet, {"temperature": 0.0}, model)
    assert [r.generation.token_ids for r in together] == [r.generation.token_ids for r in alone]  # type: ignore[union-attr]
    assert all(r.generation.timings.batch_size_max == 1 for r in alone)  # type: ignore[union-attr]
    assert max(r.generation.timings.batch_size_max for r in together) > 1  # type: ignore[union-attr]
    for r in together:
        gen = r.generation
        assert gen is not None and gen.usage.completion_tokens == len(gen.token_ids)
        assert gen.finish_reason in ("length", "stop") and gen.text is not None


def test_seeded_sampling_is_the_same_alone_and_batched(fleet: Fleet) -> None:
    alone, together = _alone_then_together(fleet, {"temperature": 0.9, "top_k": 40, "top_p": 0.95})
    assert [r.generation.token_ids for r in together] == [r.generation.token_ids for r in alone]  # type: ignore[union-attr]
    assert max(r.generation.timings.batch_size_max for r in together) > 1  # type: ignore[union-attr]


def _read_stream(client: FleetClient, rid: str, into: list[StreamEvent]) -> None:
    into.extend(client.stream(rid, timeout_s=120))


def test_sigkill_redelivery_regenerates_the_same_sampled_tokens_and_stream(fleet: Fleet) -> None:
    cfg = fleet.config(
        visibility_timeout_s=3,
        models={MODEL: {"limits": {"max_new_tokens": 440}, "batching": {"max_batch_size": 8}}},
    )
    a = fleet.worker(cfg, concurrency=8)
    client = fleet.client(cfg)
    params = {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 440, "ignore_eos": True}
    prompts = [[5 + i, 40 + i, 77] for i in range(6)]
    ids = [_generate(client, p, seed=100 + i, **params) for i, p in enumerate(prompts)]
    streams: list[list[StreamEvent]] = [[] for _ in ids]
    readers = [
        threading.Thread(target=_read_stream, args=(client, rid, s)) for rid, s in zip(ids, streams, strict=True)
    ]
    for t in readers:
        t.start()
    deadline = time.monotonic() + 60
    while not all(s for s in streams):  # every request is generating on worker A
        assert time.monotonic() < deadline, a.log_tail()
        time.sleep(0.005)
    a.kill()
    assert not any(s and s[-1].is_last for s in streams), "worker A finished before it was killed: nothing tested"
    fleet.worker(cfg, concurrency=8)
    results = [_result(client, rid) for rid in ids]
    for t in readers:
        t.join(60)
    for result, events in zip(results, streams, strict=True):
        gen = result.generation
        assert gen is not None and len(gen.token_ids) == 440
        assert [e.index for e in events[:-1]] == list(range(440))  # each index once, across the redelivery
        assert [e.token_id for e in events[:-1]] == gen.token_ids
        assert "".join(e.text for e in events) == gen.text
        assert events[-1].type == "final" and events[-1].finish_reason == "length"
    # the same requests alone on a fresh worker give the same tokens: sampling is a function of the request
    again = [_result(client, _generate(client, p, seed=100 + i, **params)) for i, p in enumerate(prompts)]
    assert [r.generation.token_ids for r in again] == [r.generation.token_ids for r in results]  # type: ignore[union-attr]


def _final_entry_ids(r: redis.Redis, ids: list[str]) -> dict[str, tuple[int, int]]:
    """Redis stream entry ID (server ms, seq) of each request's final event: the completion order."""
    order = {}
    for rid in ids:
        for entry_id, fields in r.xrange(STREAM_KEY.format(id=rid)):
            if any(event.is_last for event in decode_events(fields)):  # a coalesced entry may end with it
                ms, seq = entry_id.decode().split("-")
                order[rid] = (int(ms), int(seq))
    return order


def test_short_request_overtakes_running_long_generations(fleet: Fleet, endless_decoder: Path) -> None:
    """A short generation submitted while long ones run joins them and ends first. The long ones ask for
    ENDLESS_TOKENS (they end only when cancelled), so the order proves the join, not a race of durations
    (beside a CPU hog, 400-token long ones had ended before the short one was even taken)."""
    budget = 4 * (ENDLESS_TOKENS + 2) + 3 + 3  # every long reservation and the short one's fit together
    cfg = fleet.config(models={MODEL: {"path": str(endless_decoder), "limits": {"max_new_tokens": ENDLESS_TOKENS},
                                       "batching": {"max_batch_size": 8, "max_kv_tokens": budget}}})  # fmt: skip
    fleet.worker(cfg, concurrency=8)
    client = fleet.client(cfg)
    long_ids = [_generate(client, [9, 10 + i], max_new_tokens=ENDLESS_TOKENS, ignore_eos=True) for i in range(4)]
    first = next(iter(client.stream(long_ids[0], timeout_s=60)))  # the long ones are running
    assert first.type == "token"
    short = _generate(client, [11, 12, 13], max_new_tokens=3, ignore_eos=True)
    result = _result(client, short)
    assert result.generation.timings.batch_size_max > 1  # type: ignore[union-attr]  # it ran beside them
    assert [client.status(rid) for rid in long_ids] == [RequestStatus.RUNNING] * 4  # they run on
    r = redis.Redis.from_url(fleet.redis_url)
    assert _final_entry_ids(r, long_ids) == {}  # no long stream has ended
    for rid in long_ids:
        assert client.cancel(rid, settle_s=60)
    assert {_result(client, rid).generation.finish_reason for rid in long_ids} == {"cancelled"}  # type: ignore[union-attr]


def test_cancel_stops_a_running_generation_and_frees_its_slot(fleet: Fleet) -> None:
    cfg = fleet.config(models={MODEL: {"limits": {"max_new_tokens": 480}, "batching": {"max_batch_size": 1}}})
    fleet.worker(cfg, concurrency=2)
    client = fleet.client(cfg)
    running = _generate(client, [20, 21], max_new_tokens=480, ignore_eos=True)
    waiting = _generate(client, [22, 23], max_new_tokens=4, ignore_eos=True)  # needs the one slot
    seen = 0
    for event in client.stream(running, timeout_s=60):
        seen = event.index + 1
        if seen >= 5:
            break
    assert client.cancel(running, settle_s=60)
    # answered once it stopped (as DELETE /v1/requests/{id} and `fleet cancel` are): not "running" any more
    assert client.status(running) is RequestStatus.SUCCEEDED
    cancelled = _result(client, running)
    gen = cancelled.generation
    assert gen is not None and gen.finish_reason == "cancelled"
    assert seen <= len(gen.token_ids) < 480
    assert _result(client, waiting).generation.finish_reason == "length"  # type: ignore[union-attr]
    events = list(client.stream(running, timeout_s=10))
    assert events[-1].finish_reason == "cancelled" and events[-1].usage.completion_tokens == len(gen.token_ids)  # type: ignore[union-attr]


def test_invalid_generation_fails_with_the_field_and_ends_its_stream(fleet: Fleet) -> None:
    cfg = fleet.config()
    fleet.worker(cfg)
    client = fleet.client(cfg)
    app_client = client.app
    res = app_client.send_task(
        "fleet.infer",
        args=[{"model": MODEL, "input_ids": [5] * 10,
               "output": {"kind": "generate", "generation": {"max_new_tokens": 600}}}],
        queue="fleet.demo-lm",
        task_id="too-long-gen",
    )
    res.get(timeout=30, propagate=False)
    assert res.state == "FAILURE"
    assert "max_new_tokens" in str(res.result)
    events = list(client.stream("too-long-gen", timeout_s=10))
    assert events[-1].type == "error" and events[-1].field == "output.generation.max_new_tokens"


def test_a_reader_that_saw_a_stream_end_finds_the_request_s_terminal_state(fleet: Fleet) -> None:
    """The event that ends a stream (``final``, ``error``) is written after the request's result is stored:
    a client that read a stream to its end and then asked for the status, without waiting, got ``running``
    when the worker's stream publisher won the race against the result store."""
    cfg = fleet.config()
    fleet.worker(cfg)
    client = fleet.client(cfg)
    monitor = Monitor(fleet.redis_url)
    try:
        ended = {_generate(client, [40 + i, 41], max_new_tokens=6, ignore_eos=True): "succeeded" for i in range(6)}
        client.app.send_task(  # valid for the producer's checks, refused by the worker's: an error event
            "fleet.infer", task_id="too-long-to-stream", queue="fleet.demo-lm",
            args=[{"model": MODEL, "input_ids": [5] * 10,
                   "output": {"kind": "generate", "generation": {"max_new_tokens": 600, "stream": True}}}],
        )
        ended["too-long-to-stream"] = "failed"
        statuses = {}
        for rid in ended:
            events = list(client.stream(rid, timeout_s=60))
            statuses[rid] = client.status(rid)  # at once: the stream's end says the request is done
            assert events[-1].type == ("final" if ended[rid] == "succeeded" else "error")
        commands = [c["command"] for c in monitor.up_to_now()]
    finally:
        monitor.close()
    assert statuses == ended
    for rid in ended:  # Redis's own order: the result's store, then the stream's end
        stored = next(i for i, c in enumerate(commands) if c.startswith(f"SET celery-task-meta-{rid} ")
                      and ('"status": "SUCCESS"' in c or '"status": "FAILURE"' in c))  # not its STARTED
        end = next(i for i, c in enumerate(commands) if c.startswith(f"XADD {STREAM_KEY.format(id=rid)} ")
                   and ('"final"' in c or '"error"' in c))  # fmt: skip
        assert stored < end, rid


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_generation_metrics_count_tokens_first_tokens_and_finish_reasons(fleet: Fleet) -> None:
    port = free_port()
    cfg = fleet.config(worker={"metrics_port": port})
    fleet.worker(cfg)
    client = fleet.client(cfg)
    ids = [_generate(client, [30 + i, 31], max_new_tokens=6, ignore_eos=True) for i in range(5)]
    results = [_result(client, rid) for rid in ids]
    generated = sum(len(r.generation.token_ids) for r in results)  # type: ignore[union-attr]
    deadline = time.monotonic() + 10
    while True:  # the success signal lands just after the result is stored
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        if _metric(text, "fleet_worker_time_to_first_token_seconds_count") >= 5 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert _metric(text, "fleet_worker_generated_tokens_total") == generated == 30
    prompted = sum(r.generation.usage.prompt_tokens for r in results)  # type: ignore[union-attr]
    assert _metric(text, "fleet_worker_prompt_tokens_total") == prompted == 10
    assert _metric(text, "fleet_worker_generation_finished_total", reason="length") == 5
    assert _metric(text, "fleet_worker_time_to_first_token_seconds_count") == 5
    assert _metric(text, "fleet_worker_inter_token_seconds_count") == 5
    assert _metric(text, "fleet_worker_running_sequences") == 0
    assert _metric(text, "fleet_worker_kv_in_place") == 1
    assert f'fleet_worker_cuda_graphs{{model="{MODEL}"}} 0.0' in text.splitlines()  # the CPU provider has none
    listening = {c.laddr.ip for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == port
                 and c.status == psutil.CONN_LISTEN}
    assert listening == {"127.0.0.1"}  # where the gateway binds by default, not 0.0.0.0


def test_fleet_submit_stream_prints_text_before_the_request_completes(fleet: Fleet) -> None:
    """The CLI's stream reader asked for tokens past the first ones before the worker stored the result (Redis's
    MONITOR: the order a starved reader's own clock cannot show), and printed the whole text."""
    cfg = fleet.config(models={MODEL: {"limits": {"max_new_tokens": 480}}})
    worker = fleet.worker(cfg)
    assert worker.proc is not None
    client = fleet.client(cfg)
    env = {**os.environ, "FLEET_CONFIG": str(cfg), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "producer.cli", "submit", "--model", MODEL, "--text", "Hello", "--stream",
           "--max-new-tokens", "480", "--ignore-eos", "--request-id", "cli-stream-1"]
    monitor = Monitor(fleet.redis_url)
    r = redis.Redis.from_url(fleet.redis_url)
    try:
        # the worker is stopped once its first events are out, until the reader asked for more: a reader starved
        # beside a CPU hog could otherwise read the whole generation in its first XREAD, proving nothing (slowed
        # until then, so that the generation outlasts a starved test's first read)
        with Throttled(worker.proc.pid) as throttled:
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            r.xread({STREAM_KEY.format(id="cli-stream-1"): "0"}, count=1, block=60_000)
            throttled.stop()
            held = not ended(r.get("celery-task-meta-cli-stream-1"))  # stopped mid-generation
            if held:
                poll_until(lambda: asked_past_first([c["command"] for c in monitor.commands], "cli-stream-1"), 60,
                           "the CLI's reader to ask for the entries after those it printed")  # fmt: skip
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        commands = [c["command"] for c in monitor.up_to_now()]
    finally:
        monitor.close()
        r.close()
    assert held, "the worker finished the generation before it could be stopped"
    assert relayed_before_stored(commands, "cli-stream-1")
    first, out = out[:1], out[1:]
    summary = json.loads(err.decode().strip().splitlines()[-1])
    assert summary == {"request_id": "cli-stream-1", "finish_reason": "length",
                       "usage": {"prompt_tokens": 5, "completion_tokens": 480, "total_tokens": 485, "cached_tokens": 0}}
    result = _result(client, "cli-stream-1")
    assert (first + out).decode().rstrip("\n") == result.generation.text  # type: ignore[union-attr]


def test_llama_layout_serves_next_token_top_k_from_the_same_worker(fleet: Fleet) -> None:
    cfg = fleet.config(worker={"model": "demo-llama"})
    fleet.worker(cfg, model="demo-llama")
    client = fleet.client(cfg)
    top = client.result(client.submit("demo-llama", [5, 6, 7], top_k=3), wait=True, timeout_s=30)
    greedy = _result(client, _generate(client, [5, 6, 7], "demo-llama", max_new_tokens=1))
    assert top is not None and top.top_k is not None and len(top.top_k) == 3
    assert greedy.generation.token_ids == [top.top_k[0].token_id]  # type: ignore[union-attr]


def test_bad_generation_arguments_raise_fleet_errors_naming_the_field(fleet: Fleet) -> None:
    client = fleet.client(fleet.config())
    with pytest.raises(InvalidRequest) as info:
        client.submit(MODEL, [5], generation={"temperature": -1})
    assert info.value.field == "output.generation.temperature"
    with pytest.raises(InvalidRequest) as info:
        client.submit(MODEL, [5], generation={"max_new_tokens": 10_000})
    assert info.value.field == "output.generation.max_new_tokens" and info.value.limit == 256
    with pytest.raises(InvalidRequest) as info:
        client.submit(MODEL, [5], generation={"stop": [""]})
    assert info.value.field == "output.generation.stop"
    with pytest.raises(InvalidRequest) as info:
        client.submit("demo-encoder", [5], generation={"max_new_tokens": 4})
    assert info.value.field == "output.kind"


def test_generations_that_arrive_together_start_in_the_same_step(fleet: Fleet) -> None:
    """Eight generations queued in one Redis step reach an idle worker over some milliseconds (a pool
    thread each): the first waits for the others the worker already holds (``start_together_ms``), so
    all eight are prefilled together and every decode step carries all eight; before, the first was
    prefilled alone and decoded alone until the others caught up."""
    cfg = fleet.config(models={MODEL: {"batching": {"max_batch_size": 8, "start_together_ms": 10_000}}})
    fleet.worker(cfg, concurrency=8)
    client = fleet.client(cfg)
    for attempt in range(3):  # warm, then twice more: each burst must start together
        built = [client.build_request(MODEL, [3 + 20 * attempt + i, 9, 10], generation={
            "max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True, "stream": False}) for i in range(8)]
        results = [_result(client, rid) for rid in client.send_batch(built)]
        sizes = [r.generation.timings.batch_size_min for r in results]  # type: ignore[union-attr]
        detail = [(r.generation.timings.batch_size_min, r.generation.timings.batch_size_max,  # type: ignore[union-attr]
                   r.generation.timings.decode_steps, round(r.timings.batch_started_unix_s or 0, 3),  # type: ignore[union-attr]
                   len(r.generation.token_ids)) for r in results]  # type: ignore[union-attr]
        assert sizes == [8] * 8, (attempt, detail)  # from its first decode step, each ran with all eight
