"""The token-stream ledger under worker faults, end to end: real ``celery worker`` subprocesses, real
redis-server, two real gateway replicas. Every reader of a generation — native SSE on either gateway (their
stream hubs), ``FleetClient.stream``, one joining late, one slow — ends exactly once, with the same token
events (index, token id, text per token) as every other reader, the stored result's ``token_ids`` in order,
its text, finish reason and usage.

The worker is frozen (SIGSTOP) mid-generation so that the faults land while it generates, whatever the
machine's load: then SIGKILLed (another worker takes the redelivery and writes the stream again from index 0),
or SIGTERMed (a warm shutdown finishes the generation).
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from producer.client import FleetClient
from protocol.messages import InferenceResult
from protocol.settings import load_settings
from tests.integration.ops_fixtures import API_KEY, OpsFleet, ops_fleet, ops_models, ops_redis, wait_until

__all__ = ["ops_fleet", "ops_models", "ops_redis"]

MAX_TOKENS = 300
READ_TIMEOUT_S = 60.0


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


def _signal(pid: int, sig: signal.Signals) -> None:
    os.killpg(pid, sig)  # the worker's process group: Celery's main process and its pool threads


def _check_ledger(readers: list[Reader], result: InferenceResult) -> None:
    gen = result.generation
    assert gen is not None and len(gen.token_ids) == MAX_TOKENS
    assert not [r.error for r in readers if r.error], {r.name: r.error for r in readers}
    assert {r.name: r.ends for r in readers} == {r.name: 1 for r in readers}  # each ended, once
    first = readers[0].tokens
    for r in readers:
        assert [i for _, i, _, _ in r.tokens] == list(range(MAX_TOKENS)), r.name  # none missing, twice or out of order
        assert [t for _, _, t, _ in r.tokens] == gen.token_ids, r.name
        assert r.tokens == first, r.name  # the same text per token: none finished from the stored result
        assert "".join(text for *_, text in r.events) == gen.text, r.name
        assert r.last is not None and r.last["type"] == "final", (r.name, r.last)
        assert r.last["finish_reason"] == gen.finish_reason, r.name
        assert r.last["usage"] == gen.usage.model_dump(mode="json"), r.name


def test_a_warm_shutdown_mid_generation_ends_every_stream_with_the_stored_result(ops_fleet: OpsFleet) -> None:
    cfg = ops_fleet.config(serve=("demo-lm",), models={"demo-lm": {"limits": {"max_new_tokens": MAX_TOKENS}}})
    worker = ops_fleet.worker(cfg)
    gateway = ops_fleet.gateway(cfg)
    client = FleetClient(load_settings(cfg))
    try:
        rid = client.submit("demo-lm", [9, 8, 7], kind="generate",
                            generation={"max_new_tokens": MAX_TOKENS, "ignore_eos": True})
        readers = [Reader("client.stream").run(_client_stream(client, rid))]
        wait_until(lambda: len(readers[0].events) >= 5 or readers[0].done.is_set(), 60, "the first tokens")
        assert worker.proc is not None
        _signal(worker.proc.pid, signal.SIGSTOP)
        assert client.result(rid) is None, "it finished before the fault: nothing tested"
        readers.append(Reader("sse").run(_sse(gateway.url, rid)))
        _signal(worker.proc.pid, signal.SIGTERM)  # delivered as it runs again: a warm shutdown mid-generation
        _signal(worker.proc.pid, signal.SIGCONT)
        for r in readers:
            assert r.done.wait(READ_TIMEOUT_S + 30), f"{r.name} did not end: {len(r.events)} events"
        result = client.result(rid, wait=True, timeout_s=30)
        assert worker.proc.wait(60) == 0, worker.log_tail()
    finally:
        client.close()
    assert isinstance(result, InferenceResult)
    _check_ledger(readers, result)
