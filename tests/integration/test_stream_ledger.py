"""The token-stream ledger under worker faults, end to end: real ``celery worker`` subprocesses, real
redis-server, two real gateway replicas. Every reader of a generation — native SSE on either gateway (their
stream hubs), ``FleetClient.stream``, one joining late, one slow — ends exactly once, with the same token
events (index, token id, text per token) as every other reader, the stored result's ``token_ids`` in order,
its text, finish reason and usage.

The generations ask for :data:`ENDLESS_TOKENS` tokens of a decoder with room for them: they end only when the
test cancels them. The worker is frozen (SIGSTOP) mid-generation so that the faults land while it generates,
whatever the machine's load: then SIGKILLed (another worker takes the redelivery and writes the stream again
from index 0), or SIGTERMed (a warm shutdown lets the generation run on). Before, they asked for 300 tokens,
and in one fresh-clone run all 300 were written before the SIGSTOP: nothing was left to redeliver.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from producer.client import FleetClient, RequestStatus
from protocol.keys import STREAM_KEY, WORKER_KEY_PREFIX
from protocol.messages import InferenceResult
from protocol.settings import load_settings
from protocol.streams import decode_events
from tests.integration.ops_fixtures import API_KEY, OpsFleet, ops_fleet, ops_models, ops_redis, wait_until
from tests.integration.test_generation_adversary_worker import ENDLESS_TOKENS, endless_decoder
from tools.processes import WorkerProcess

__all__ = ["endless_decoder", "ops_fleet", "ops_models", "ops_redis"]  # the decoder: test_generation_adversary_worker's

READ_TIMEOUT_S = 120.0
"""A reader's bound on silence (s): the streams are silent while a worker is frozen, killed and replaced."""


def _config(fleet: OpsFleet, decoder: Path, **overrides: Any) -> Path:
    """demo-lm served by ``decoder``, up to :data:`ENDLESS_TOKENS`; a slow reader's held socket is never cut
    (``api.write_stall_s`` past the test's length: the cut would cancel the request)."""
    return fleet.config(serve=("demo-lm",), api={"write_stall_s": 3600},
                        models={"demo-lm": {"path": str(decoder), "limits": {"max_new_tokens": ENDLESS_TOKENS}}},
                        **overrides)  # fmt: skip


@dataclass
class Reader:
    """One stream read on a thread: its events as (type, index, token id, text), and how it ended."""

    name: str
    events: list[tuple[str, int, int | None, str]] = field(default_factory=list)
    last: dict[str, Any] | None = None
    error: str | None = None
    ends: int = 0
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def tokens(self) -> list[tuple[str, int, int | None, str]]:
        return [e for e in self.events if e[0] == "token"]

    def take(self, event: dict[str, Any]) -> None:
        self.events.append((event["type"], event["index"], event.get("token_id"), event.get("text", "")))
        if event["type"] != "token":
            self.ends += 1
            self.last = event

    def run(self, body: Callable[[Reader], None]) -> Reader:
        def guarded() -> None:
            try:
                body(self)
            except Exception as exc:  # reported by the test: a reader that raised did not end its stream
                self.error = f"{type(exc).__name__}: {exc}"
            finally:
                self.done.set()

        threading.Thread(target=guarded, name=f"read-{self.name}", daemon=True).start()
        return self


def _sse(base_url: str, rid: str, hold: threading.Event | None = None) -> Callable[[Reader], None]:
    """Read ``GET /v1/requests/{rid}/stream``; with ``hold``, stop reading after the first event until it is set
    (a slow client: the gateway's writes wait in the socket's buffers)."""

    def body(r: Reader) -> None:
        timeout = httpx.Timeout(10.0, read=READ_TIMEOUT_S)
        with httpx.stream("GET", f"{base_url}/v1/requests/{rid}/stream", headers={"X-API-Key": API_KEY},
                          timeout=timeout) as resp:
            resp.raise_for_status()
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    r.take(json.loads(line[len("data: "):]))
                    if hold is not None and len(r.events) == 1:
                        hold.wait(READ_TIMEOUT_S)

    return body


def _client_stream(client: FleetClient, rid: str) -> Callable[[Reader], None]:
    def body(r: Reader) -> None:
        for event in client.stream(rid, timeout_s=READ_TIMEOUT_S):
            r.take(event.model_dump(mode="json", exclude_none=True))

    return body


def _signal(worker: WorkerProcess, sig: signal.Signals) -> None:
    assert worker.proc is not None
    os.killpg(worker.proc.pid, sig)  # the worker's process group: Celery's main process and its pool threads


def _stopped(pid: int) -> bool:
    """Whether every thread of process ``pid`` is stopped (state ``T`` in ``/proc``): a kill(SIGSTOP) returns
    before the threads on other cores have stopped."""
    states = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
        except (OSError, IndexError):  # a thread that ended meanwhile
            continue
    return bool(states) and all(state in ("T", "t") for state in states)


def _written(r: redis.Redis[bytes], rid: str) -> int:
    """The tokens the generation's stream holds now (the highest token index + 1): with its worker frozen,
    all that attempt will have written."""
    indices = [event.index for _, fields in r.xrange(STREAM_KEY.format(id=rid))
               for event in decode_events(fields) if event.type == "token"]  # fmt: skip
    return max(indices, default=-1) + 1


def _frozen_unfinished(client: FleetClient, rid: str, worker: WorkerProcess) -> None:
    """SIGSTOP ``worker`` and check the generation it runs has not ended (it cannot: it asks for
    :data:`ENDLESS_TOKENS`; a failure here says the fault would test nothing)."""
    _signal(worker, signal.SIGSTOP)
    assert worker.proc is not None
    pid = worker.proc.pid
    wait_until(lambda: _stopped(pid), 30, "every thread of the worker stopped")  # none still writing to Redis
    assert client.result(rid) is None and client.status(rid) is RequestStatus.RUNNING, "it ended before the fault"


def _cancel_frozen(client: FleetClient, rid: str, worker: WorkerProcess) -> None:
    """End the generation that frozen ``worker`` runs: the cancel mark is set before the worker runs again, and
    it stops within one decode step of waking (its tokens so far are its result, ``finish_reason`` cancelled)."""
    assert client.cancel(rid)
    _signal(worker, signal.SIGCONT)


def _check_ledger(readers: list[Reader], result: InferenceResult, more_than: int) -> None:
    """Every reader saw the stored result token for token; it holds more than ``more_than`` tokens (those the
    first attempt, or the test, saw) and ended only by the test's cancel."""
    gen = result.generation
    assert gen is not None and gen.finish_reason == "cancelled", gen
    n = len(gen.token_ids)
    assert more_than < n < ENDLESS_TOKENS, (more_than, n)
    assert gen.usage.completion_tokens == n
    assert not [r.error for r in readers if r.error], {r.name: r.error for r in readers}
    assert {r.name: r.ends for r in readers} == {r.name: 1 for r in readers}  # each ended, once
    first = readers[0].tokens
    for r in readers:
        assert [i for _, i, _, _ in r.tokens] == list(range(n)), r.name  # none missing, twice or out of order
        assert [t for _, _, t, _ in r.tokens] == gen.token_ids, r.name
        assert r.tokens == first, r.name  # the same text per token: none finished from the stored result
        assert "".join(text for *_, text in r.events) == gen.text, r.name
        assert r.last is not None and r.last["type"] == "final", (r.name, r.last)
        assert r.last["finish_reason"] == gen.finish_reason, r.name
        assert r.last["usage"] == gen.usage.model_dump(mode="json"), r.name


def test_every_reader_keeps_the_ledger_across_a_sigkill_and_redelivery(
    ops_fleet: OpsFleet, endless_decoder: Path
) -> None:
    cfg = _config(ops_fleet, endless_decoder, visibility_timeout_s=3)
    first_worker = ops_fleet.worker(cfg)
    gateways = ops_fleet.gateway_replicas(cfg, 2)
    client = FleetClient(load_settings(cfg))
    hold_slow = threading.Event()
    try:
        rid = client.submit("demo-lm", [5, 40, 77], kind="generate", generation={
            "max_new_tokens": ENDLESS_TOKENS, "ignore_eos": True, "temperature": 0.8, "top_p": 0.9, "seed": 11})
        early = Reader("sse-gw1").run(_sse(gateways[0].url, rid))
        wait_until(lambda: len(early.events) >= 5 or early.done.is_set(), 60, "the first tokens on the first gateway")
        _frozen_unfinished(client, rid, first_worker)  # frozen mid-generation
        written = _written(ops_fleet.redis, rid)
        late = [
            Reader("sse-gw1-late").run(_sse(gateways[0].url, rid)),  # a second reader through the same hub
            Reader("sse-gw2").run(_sse(gateways[1].url, rid)),  # the other replica
            Reader("client.stream").run(_client_stream(client, rid)),
        ]
        slow = Reader("sse-gw1-slow").run(_sse(gateways[0].url, rid, hold_slow))
        # while the worker is frozen, every reader reaches what it had written, and no further
        wait_until(lambda: all(len(r.tokens) >= written or r.done.is_set() for r in [early, *late]) and slow.events,
                   60, "the readers to reach what the frozen worker wrote")  # fmt: skip
        assert [len(r.tokens) for r in [early, *late]] == [written] * 4, [r.error for r in [early, *late]]
        first_worker.kill()  # mid-generation, unacked: back to the queue after visibility_timeout_s
        second_worker = ops_fleet.worker(cfg)
        wait_until(lambda: len(early.tokens) > written or early.done.is_set(), 120, "the redelivered attempt's tokens")
        # one more joins while the second worker writes (the hub's read under way then brings entries)
        during = Reader("sse-gw1-during-redelivery").run(_sse(gateways[0].url, rid))
        wait_until(lambda: during.events or during.done.is_set(), 60, "the reader joining during the redelivery")
        _frozen_unfinished(client, rid, second_worker)
        _cancel_frozen(client, rid, second_worker)
        readers = [early, *late, during]
        for r in readers:
            assert r.done.wait(READ_TIMEOUT_S + 30), f"{r.name} did not end: {len(r.events)} events"
        hold_slow.set()
        assert slow.done.wait(READ_TIMEOUT_S + 30), f"the slow reader did not end: {len(slow.events)} events"
        result = client.result(rid, wait=True, timeout_s=60)
        assert client.status(rid) is RequestStatus.SUCCEEDED  # one terminal state: the cancelled generation's result
        again = client.result(rid, wait=True, timeout_s=5)
    finally:
        hold_slow.set()
        client.close()
    assert isinstance(result, InferenceResult) and again is not None
    assert again.model_dump() == result.model_dump()  # stored once: nothing overwrote it
    _check_ledger([*readers, slow], result, written)


def test_a_warm_shutdown_mid_generation_ends_every_stream_with_the_stored_result(
    ops_fleet: OpsFleet, endless_decoder: Path
) -> None:
    cfg = _config(ops_fleet, endless_decoder)
    worker = ops_fleet.worker(cfg)
    gateway = ops_fleet.gateway(cfg)
    client = FleetClient(load_settings(cfg))
    try:
        rid = client.submit("demo-lm", [9, 8, 7], kind="generate",
                            generation={"max_new_tokens": ENDLESS_TOKENS, "ignore_eos": True})
        readers = [Reader("client.stream").run(_client_stream(client, rid))]
        wait_until(lambda: len(readers[0].events) >= 5 or readers[0].done.is_set(), 60, "the first tokens")
        _frozen_unfinished(client, rid, worker)
        readers.append(Reader("sse").run(_sse(gateway.url, rid)))
        _signal(worker, signal.SIGTERM)  # delivered as it runs again: a warm shutdown mid-generation
        _signal(worker, signal.SIGCONT)
        heartbeat = WORKER_KEY_PREFIX + worker.hostname
        wait_until(lambda: b"shutting down" in (ops_fleet.redis.get(heartbeat) or b""), 60, "the warm shutdown")
        shutting = _written(ops_fleet.redis, rid)
        # the warm shutdown lets the generation run on: tokens written after it began
        wait_until(lambda: len(readers[0].tokens) > shutting or readers[0].done.is_set(), 60,
                   "tokens after the shutdown began")  # fmt: skip
        _frozen_unfinished(client, rid, worker)
        _cancel_frozen(client, rid, worker)
        for r in readers:
            assert r.done.wait(READ_TIMEOUT_S + 30), f"{r.name} did not end: {len(r.events)} events"
        result = client.result(rid, wait=True, timeout_s=30)
        assert worker.proc is not None and worker.proc.wait(60) == 0, worker.log_tail()
    finally:
        client.close()
    assert isinstance(result, InferenceResult)
    _check_ledger(readers, result, shutting)
