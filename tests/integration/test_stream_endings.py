"""Every stream ends, whatever ends its generation: a generation cancelled mid-stream (by `DELETE`) and one
refused before it ran (its deadline passed while it was queued) end every reader of it — the native SSE
route, the Python client, and the OpenAI completions stream through the official SDK — with the request's
one terminal state, and every reader's tokens are the stored result's.

The generation asks for 20,000 tokens of a model with room for them, so it ends only when the test cancels
it; the refused one is queued while no worker serves its model and its deadline is past before a worker
starts. Real gateway and worker processes, a real Redis.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai

from producer.client import FleetClient
from protocol.errors import RequestExpired
from protocol.messages import InferenceResult
from protocol.settings import load_settings
from protocol.streams import StreamEvent
from tests.integration.ops_fixtures import API_KEY, OpsFleet, ops_fleet, ops_models, ops_redis, wait_until
from tests.integration.test_generation_adversary_worker import ENDLESS_TOKENS, endless_decoder

__all__ = ["endless_decoder", "ops_fleet", "ops_models", "ops_redis"]  # the decoder: test_generation_adversary_worker's

MODEL = "demo-lm"


def _config(fleet: OpsFleet, decoder: Path) -> Path:
    return fleet.config(serve=(MODEL,), models={MODEL: {"path": str(decoder),
                                                        "limits": {"max_new_tokens": ENDLESS_TOKENS}}})  # fmt: skip


class SSEReader:
    """Reads ``GET /v1/requests/{id}/stream`` on a thread: every event, and whether the stream ended."""

    def __init__(self, url: str, request_id: str) -> None:
        self.events: list[dict[str, Any]] = []
        self.ended = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(url, request_id), daemon=True)
        self._thread.start()

    def _run(self, url: str, request_id: str) -> None:
        try:
            with httpx.stream("GET", f"{url}/v1/requests/{request_id}/stream", headers={"X-API-Key": API_KEY},
                              timeout=httpx.Timeout(120, connect=10)) as sse:  # fmt: skip
                for line in sse.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(json.loads(line[len("data: "):]))
        except BaseException as exc:  # the test reports it
            self.error = exc
        finally:
            self.ended.set()

    def tokens(self) -> list[int]:
        return [e["token_id"] for e in self.events if e["type"] == "token"]


class ClientReader:
    """Reads ``FleetClient.stream`` on a thread: every event, and whether the stream ended."""

    def __init__(self, client: FleetClient, request_id: str) -> None:
        self.events: list[StreamEvent] = []
        self._thread = threading.Thread(target=self._run, args=(client.stream(request_id, timeout_s=120),),
                                        daemon=True)  # fmt: skip
        self._thread.start()

    def _run(self, events: Iterator[StreamEvent]) -> None:
        for event in events:
            self.events.append(event)

    def ended(self, timeout_s: float) -> bool:
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


def _readers(gateway: str, client: FleetClient, request_id: str) -> tuple[SSEReader, ClientReader]:
    """The gateway's SSE route and the Python client, each reading ``request_id``'s stream on a thread."""
    return SSEReader(gateway, request_id), ClientReader(client, request_id)


def _both_end(sse: SSEReader, native: ClientReader, after: str) -> None:
    assert sse.ended.wait(60), f"the SSE stream did not end after {after}"
    assert native.ended(60), f"the Python client's stream did not end after {after}"
    assert sse.error is None, sse.error


def test_a_generation_cancelled_mid_stream_ends_every_reader_with_its_one_outcome(
    ops_fleet: OpsFleet, endless_decoder: Path
) -> None:
    cfg = _config(ops_fleet, endless_decoder)
    gateway = ops_fleet.gateway(cfg)
    ops_fleet.worker(cfg, MODEL)
    client = FleetClient(load_settings(cfg))
    http = httpx.Client(base_url=gateway.url, headers={"X-API-Key": API_KEY}, timeout=60)
    generation = {"max_new_tokens": ENDLESS_TOKENS, "ignore_eos": True}
    accepted = http.post("/v1/requests", json={"model": MODEL, "input_ids": [5, 6, 7],
                                               "output": {"generation": generation}})  # fmt: skip
    assert accepted.status_code == 202, accepted.text
    rid = accepted.json()["request_id"]
    sse, native = _readers(gateway.url, client, rid)
    seen = native.events
    wait_until(lambda: len(sse.tokens()) >= 3 and len(seen) >= 3, 60, "both readers to see tokens")

    assert http.delete(f"/v1/requests/{rid}").status_code in (200, 202)
    _both_end(sse, native, "the cancel")
    (outcome,) = client.wait([rid], timeout_s=60)
    status = http.get(f"/v1/requests/{rid}").json()
    print(f"\ncancelled mid-stream after {len(sse.tokens())} SSE tokens and {len(seen) - 1} client tokens: SSE "
          f"ends {sse.events[-1]}; client ends {seen[-1].model_dump(exclude_none=True)}; status {status['status']}")
    # a running generation that is cancelled succeeds with the tokens made so far (README: DELETE)
    assert isinstance(outcome, InferenceResult) and outcome.generation is not None, outcome
    stored = outcome.generation
    assert status["status"] == "succeeded" and stored.finish_reason == "cancelled"
    for events in (sse.events, [e.model_dump() for e in seen]):
        assert events[-1]["type"] == "final" and events[-1]["finish_reason"] == "cancelled", events[-1]
        assert [e["token_id"] for e in events if e["type"] == "token"] == stored.token_ids  # every token once
        assert "".join(e["text"] for e in events) == stored.text
    again = http.get(f"/v1/requests/{rid}/stream")  # a reader after the end gets the same stream at once
    assert [json.loads(line[len("data: "):]) for line in again.text.splitlines() if line.startswith("data: ")] \
        == sse.events
    http.close()


def test_an_openai_completion_stream_cancelled_by_its_request_id_ends_with_the_text_so_far(
    ops_fleet: OpsFleet, endless_decoder: Path
) -> None:
    cfg = _config(ops_fleet, endless_decoder)
    gateway = ops_fleet.gateway(cfg)
    ops_fleet.worker(cfg, MODEL)
    sdk = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    raw = sdk.completions.with_raw_response.create(model=MODEL, prompt=[5, 6, 7], max_tokens=ENDLESS_TOKENS,
                                                   stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    rid = raw.headers["x-request-id"]
    texts: list[str] = []
    reasons: list[str | None] = []
    cancelled = False
    for chunk in raw.parse():  # ends: the SDK stops at [DONE]; an error chunk would raise APIError
        texts.extend(choice.text for choice in chunk.choices)
        reasons.extend(choice.finish_reason for choice in chunk.choices)
        if len(texts) >= 3 and not cancelled:
            cancelled = httpx.delete(f"{gateway.url}/v1/requests/{rid}", headers={"X-API-Key": API_KEY},
                                     timeout=30).status_code in (200, 202)  # fmt: skip
    status = httpx.get(f"{gateway.url}/v1/requests/{rid}", headers={"X-API-Key": API_KEY}, timeout=30).json()
    generation = status["result"]["generation"]
    print(f"\nOpenAI completion stream cancelled by its request ID: {len(texts)} chunks, finish_reason "
          f"{reasons[-1]!r}; native status {status['status']} ({generation['finish_reason']}, "
          f"{len(generation['token_ids'])} tokens)")
    assert cancelled
    assert reasons[-1] == "stop"  # OpenAI has no "cancelled": README, OpenAI-compatible API
    assert status["status"] == "succeeded" and generation["finish_reason"] == "cancelled"
    assert "".join(texts) == generation["text"]


def test_a_generation_refused_before_it_ran_ends_its_waiting_readers(
    ops_fleet: OpsFleet, endless_decoder: Path
) -> None:
    cfg = _config(ops_fleet, endless_decoder)
    gateway = ops_fleet.gateway(cfg)
    client = FleetClient(load_settings(cfg))
    http = httpx.Client(base_url=gateway.url, headers={"X-API-Key": API_KEY}, timeout=60)
    deadline_s = 1.0
    submitted = time.time()
    accepted = http.post("/v1/requests", json={"model": MODEL, "input_ids": [5, 6, 7], "deadline_s": deadline_s,
                                               "output": {"generation": {"max_new_tokens": 8}}})  # fmt: skip
    assert accepted.status_code == 202, accepted.text
    rid = accepted.json()["request_id"]
    sse, native = _readers(gateway.url, client, rid)  # waiting on a stream no worker has begun
    seen = native.events
    wait_until(lambda: time.time() > submitted + deadline_s, 10, "the deadline to pass")  # past, then the worker
    ops_fleet.worker(cfg, MODEL)
    _both_end(sse, native, "the refusal")
    (outcome,) = client.wait([rid], timeout_s=60)
    print(f"\nrefused before it ran: SSE {sse.events}; client {[e.model_dump(exclude_none=True) for e in seen]}; "
          f"outcome {type(outcome).__name__}")
    assert isinstance(outcome, RequestExpired), outcome
    assert not sse.tokens() and not [e for e in seen if e.type == "token"]
    assert sse.events[-1]["type"] == "error" and seen[-1].type == "error" and seen[-1].is_last
    assert sse.events[-1]["error"] == seen[-1].error == "RequestExpired"
    http.close()
