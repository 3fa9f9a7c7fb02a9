"""Token streams across a Redis SIGKILL + restart (same port, no persistence), under 16 running generations.

One worker (concurrency 16) runs 16 streamed generations of a decoder slow enough to be mid-way
when Redis dies: 8 queued with :class:`FleetClient` and each read twice, by ``client.stream`` and by
the native SSE route (``GET /v1/requests/{id}/stream``), and 8 asked through the official ``openai``
SDK with ``stream=True`` (4 completions, 4 chat). Once every stream has handed on
:data:`EVENTS_BEFORE_KILL` events, redis-server is SIGKILLed and started again on its port, empty.
Every stream must then end, with the text and token count of the request's stored result: the worker
holds the events it could not write and writes them when Redis answers, and a reader that finds
the result stored while its stream stopped short (the entries before the kill are gone) finishes
from the result. Run twice: with the worker's default hold, and with a hold of one event
(``worker.stream_hold_events``), so every stream loses tokens for good and each reader has to finish
from the stored result. The figures go to ``var/reliability/stream-redis-restart-<hold>.json``.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from producer.client import FleetClient
from protocol.messages import InferenceResult
from protocol.settings import load_settings
from tests.integration.fault_fixtures import RECORD_DIR
from tests.integration.ops_fixtures import API_KEY, ROOT, ModelPaths, OpsFleet, wait_until
from tools.build_lm import build_causal_lm
from tools.processes import WorkerProcess
from tools.redis_server import EmbeddedRedis

GENERATIONS = 16
MAX_TOKENS = 256
"""Tokens per generation (ignore_eos): several seconds of decoding for 16 at once on 2 loaded cores."""
EVENTS_BEFORE_KILL = 4
"""Events (client.stream / SSE) or text chunks (SDK) every stream must have handed on before the kill."""
DOWN_S = 1.0
"""How long Redis stays dead (the fault's length, not a synchronisation)."""
READ_TIMEOUT_S = 40.0
"""Longest silence a reader accepts: past it the stream counts as cut for good."""
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def slow_models(tmp_path_factory: pytest.TempPathFactory) -> ModelPaths:
    """A wider, deeper demo LM (same byte tokenizer and chat template): ~10x the demo LM's step time."""
    root = tmp_path_factory.mktemp("slow-lm")
    lm = build_causal_lm(root, hidden_size=256, num_layers=6, num_heads=4, max_positions=512)
    return ModelPaths(lm=lm, encoder=lm)


@dataclass
class Reader:
    """One stream being read on a thread: what it handed on, when, and how it ended."""

    face: str
    request_id: str = ""
    texts: list[str] = field(default_factory=list)
    token_indexes: list[int] = field(default_factory=list)
    count: int = 0
    ended_at: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    thread: threading.Thread | None = None

    def run(self, body: Callable[[Reader], None]) -> Reader:
        def guarded() -> None:
            try:
                body(self)
            except Exception as exc:  # the test reports it: a reader that raised did not end its stream
                self.error = f"{type(exc).__name__}: {exc}"

        self.thread = threading.Thread(target=guarded, name=f"read-{self.face}", daemon=True)
        self.thread.start()
        return self

    @property
    def text(self) -> str:
        return "".join(self.texts)


def _read_client_stream(client: FleetClient, rid: str) -> Callable[[Reader], None]:
    def body(r: Reader) -> None:
        r.request_id = rid
        for event in client.stream(rid, timeout_s=READ_TIMEOUT_S):
            r.texts.append(event.text)
            if event.type == "token":
                r.token_indexes.append(event.index)
            r.count += 1
            if event.is_last:
                r.finish_reason = event.finish_reason or event.error
                r.ended_at = time.monotonic()

    return body


def _read_native_sse(base_url: str, rid: str) -> Callable[[Reader], None]:
    def body(r: Reader) -> None:
        r.request_id = rid
        timeout = httpx.Timeout(10.0, read=READ_TIMEOUT_S)
        with httpx.stream("GET", f"{base_url}/v1/requests/{rid}/stream", headers={"X-API-Key": API_KEY},
                          timeout=timeout) as resp:
            resp.raise_for_status()
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[len("data: "):])
                r.texts.append(event.get("text", ""))
                if event["type"] == "token":
                    r.token_indexes.append(event["index"])
                r.count += 1
                if event["type"] != "token":
                    r.finish_reason = event.get("finish_reason") or event.get("error")
                    r.ended_at = time.monotonic()

    return body


def _read_openai(sdk: openai.OpenAI, face: str, n: int) -> Callable[[Reader], None]:
    def body(r: Reader) -> None:
        common: dict[str, Any] = {"model": "demo-lm", "max_tokens": MAX_TOKENS, "temperature": 0,
                                  "extra_body": NO_EOS, "stream": True}
        if face == "openai-completion":
            raw: Any = sdk.completions.with_raw_response.create(prompt=f"Story {n}:", **common)
        else:
            raw = sdk.chat.completions.with_raw_response.create(
                messages=[{"role": "user", "content": f"Tell story {n}"}], **common)
        r.request_id = raw.headers["x-request-id"]
        for chunk in raw.parse():
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            text = choice.text if face == "openai-completion" else (choice.delta.content or "")
            if text:
                r.texts.append(text)
                r.count += 1
            if choice.finish_reason is not None:
                r.finish_reason = choice.finish_reason
                r.ended_at = time.monotonic()

    return body


def _worker(fleet: OpsFleet, config: Path) -> WorkerProcess:
    """One demo-lm worker holding all 16 generations at once (OpsFleet's workers hold 8)."""
    settings = load_settings(config)
    proc = WorkerProcess(model="demo-lm", queue=settings.queue_for("demo-lm"), redis_url=fleet.redis_url,
                         concurrency=GENERATIONS, hostname="w-stream@restart", env={"FLEET_CONFIG": str(config)},
                         log_path=fleet.tmp_path / "worker.log", cwd=ROOT)
    fleet.workers.append(proc.start())
    proc.wait_ready(120)
    return proc


@pytest.fixture
def restart_fleet(tmp_path: Path, slow_models: ModelPaths) -> Iterator[tuple[OpsFleet, EmbeddedRedis]]:
    server = EmbeddedRedis().start()  # its own server: this test kills it
    fleet = OpsFleet(tmp_path, slow_models, server)
    try:
        yield fleet, server
    finally:
        fleet.close()
        server.stop()


@pytest.mark.parametrize("hold", ["default", "one-event"])
def test_every_stream_ends_with_the_stored_text_after_a_redis_restart(
    restart_fleet: tuple[OpsFleet, EmbeddedRedis], hold: str,
) -> None:
    fleet, server = restart_fleet
    worker_settings: dict[str, Any] = {"model": "demo-lm", "concurrency": GENERATIONS, "heartbeat_s": 0.5}
    if hold == "one-event":
        worker_settings["stream_hold_events"] = 1
    config = fleet.config(
        serve=("demo-lm",),
        worker=worker_settings,
        models={"demo-lm": {"batching": {"max_batch_size": GENERATIONS},
                            "limits": {"max_new_tokens": MAX_TOKENS, "max_input_tokens": 64}}},
        api={"max_body_bytes": 65_536},
    )
    worker = _worker(fleet, config)
    gateway = fleet.gateway(config)
    client = FleetClient(load_settings(config))
    sdk = openai.OpenAI(base_url=gateway.url + "/v1", api_key=API_KEY, max_retries=0, timeout=READ_TIMEOUT_S)
    readers: list[Reader] = []
    try:
        # the SDK's requests first (the gateway takes longer to queue them), so all 16 start close together
        for i in range(GENERATIONS // 2):
            face = "openai-completion" if i % 2 == 0 else "openai-chat"
            readers.append(Reader(face).run(_read_openai(sdk, face, i)))
        wait_until(lambda: all(r.request_id or r.error for r in readers), 60, "the gateway to queue the SDK's requests")
        for i in range(GENERATIONS // 2):
            rid = client.submit("demo-lm", [5 + i, 6, 7], kind="generate",
                                generation={"max_new_tokens": MAX_TOKENS, "ignore_eos": True})
            readers.append(Reader("client.stream").run(_read_client_stream(client, rid)))
            readers.append(Reader("native-sse").run(_read_native_sse(gateway.url, rid)))

        wait_until(lambda: all(r.count >= EVENTS_BEFORE_KILL or r.error for r in readers), 120,
                   f"every stream to hand on {EVENTS_BEFORE_KILL} events")
        assert not [r.error for r in readers if r.error], [r.error for r in readers if r.error]
        seen_at_kill = [r.count for r in readers]
        ended_before_kill = sum(r.ended_at is not None for r in readers)
        killed_at = time.monotonic()
        server.kill()
        time.sleep(DOWN_S)  # the outage's length
        server.start()
        back_at = time.monotonic()
        for r in readers:
            assert r.thread is not None
            r.thread.join(READ_TIMEOUT_S + 60)
        ids = list(dict.fromkeys(r.request_id for r in readers))
        results = dict(zip(ids, client.wait(ids, timeout_s=60), strict=True))
    finally:
        client.close()
        sdk.close()

    stored = {rid: res for rid, res in results.items() if isinstance(res, InferenceResult)}
    mismatched, unfinished = [], []
    by_face: dict[str, Counter[str]] = {}
    for r in readers:
        gen = stored[r.request_id].generation if r.request_id in stored else None
        if r.ended_at is None or gen is None:
            unfinished.append(f"{r.face} {r.request_id}: {r.count} events, error {r.error}")
            how = f"raised {r.error.split(':')[0]}" if r.error else "no end"
        elif r.text != gen.text or (r.face in ("client.stream", "native-sse") and r.token_indexes
                                    != list(range(len(gen.token_ids)))):
            mismatched.append(f"{r.face} {r.request_id}: {len(r.text)} chars vs stored {len(gen.text or '')}, "
                              f"indexes {len(r.token_indexes)} vs {len(gen.token_ids)}")
            how = f"ended ({r.finish_reason}) with other text"
        else:
            how = "ended with the stored text"
        by_face.setdefault(r.face, Counter())[how] += 1
    last_end = max((r.ended_at for r in readers if r.ended_at is not None), default=back_at)
    log = worker.log_tail(400_000)
    held_lines = [line.split("stream publisher: ", 1)[1] for line in log.splitlines() if "stream publisher: " in line]
    doc = {
        "fault": "Redis SIGKILL + restart (no persistence) under 16 running streamed generations",
        "worker_hold": hold,
        "generations": GENERATIONS, "streams": len(readers), "max_tokens": MAX_TOKENS,
        "streams_ended_with_stored_text": len(readers) - len(mismatched) - len(unfinished),
        "ended_before_kill": ended_before_kill, "events_seen_at_kill_min": min(seen_at_kill),
        "events_seen_at_kill_max": max(seen_at_kill), "down_s": round(back_at - killed_at, 2),
        "last_stream_end_after_restart_s": round(last_end - back_at, 2),
        "stored_results": len(stored), "by_face": {face: dict(c) for face, c in by_face.items()},
        "worker_log": held_lines[:6],
        "recorded_at_unix_s": time.time(),
    }
    RECORD_DIR.mkdir(parents=True, exist_ok=True)
    (RECORD_DIR / f"stream-redis-restart-{hold}.json").write_text(json.dumps(doc, indent=1))
    print("\n[stream-restart] " + json.dumps(doc))
    assert len(stored) == GENERATIONS, results
    assert ended_before_kill == 0, "a stream ended before the kill: the generations were too short to test anything"
    assert not unfinished and not mismatched, {"unfinished": unfinished, "mismatched": mismatched}
