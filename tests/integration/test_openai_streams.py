"""Streaming through a real gateway: OpenAI chunks with the SDK, tokens before the request completes,
cancel on disconnect (streaming or not), 200 concurrent streams through one gateway process, and the
native SSE route."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import openai
import pytest

from protocol.keys import CANCEL_KEY, STREAM_KEY
from protocol.streams import StreamEvent, encode_event
from tests.integration.openai_fixtures import API_KEY, Served, ops_models, ops_redis, served, stored_meta
from tests.integration.ops_fixtures import wait_until
from tests.integration.redis_monitor import Monitor
from tests.integration.stream_order import Throttled, asked_past_first, ended, relayed_before_stored

__all__ = ["ops_models", "ops_redis", "served"]

NO_EOS = {"ignore_eos": True}
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base_url, api_key=API_KEY, max_retries=0, timeout=60)


def _data_frames(lines: list[str]) -> list[str]:
    return [line[len("data: ") :] for line in lines if line.startswith("data: ")]


def test_chat_stream_tokens_arrive_before_the_request_completes(served: Served, client: openai.OpenAI) -> None:
    """Read off Redis's MONITOR, not the client's clock: a client starved by a loaded machine may parse its
    first chunk after the worker finished, though the gateway relayed it long before. The relay is a
    generator the response pulls: it asks for entries past the first ones only once their frames were
    handed to the server to send, so such an ``XREAD`` before the result is stored is that proof. The worker
    is stopped (SIGSTOP) once it has written its first events, until the relay asked for more: a gateway
    starved beside a CPU hog read all 256 tokens in its first ``XREAD`` of a 0.2 s generation, and nothing then
    showed the relay did not wait for the end."""
    worker = next(w for w in served.fleet.workers if w.model == "demo-lm")
    assert worker.proc is not None
    attempts = 0
    while attempts < 5:  # again only where the worker finished before it could be stopped
        attempts += 1
        monitor = Monitor(served.fleet.redis_url)
        try:
            with Throttled(worker.proc.pid) as throttled:  # slowed: the generation outlasts a starved test's read
                raw = client.chat.completions.with_raw_response.create(
                    model="demo-lm",
                    messages=[{"role": "user", "content": "Tell me a long story"}],
                    max_tokens=256,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body=NO_EOS,
                )
                rid = raw.headers["x-request-id"]
                assert raw.headers["content-type"].startswith("text/event-stream")
                served.redis.xread({STREAM_KEY.format(id=rid): "0"}, count=1, block=60_000)  # its first events
                throttled.stop()
                held = not ended(stored_meta(served, rid))  # stopped mid-generation: its outcome not stored
                if held:
                    wait_until(lambda m=monitor, i=rid: asked_past_first([c["command"] for c in m.commands], i), 60,
                               "the relay to ask for the entries after those it sent")  # fmt: skip
            chunks = list(raw.parse())
            stored = served.finished(rid)  # stored before the stream's end was written
            commands = [c["command"] for c in monitor.up_to_now()]
        finally:
            monitor.close()
        if held:
            break
    assert held, f"the worker finished the generation before it could be stopped, {attempts} times"
    assert relayed_before_stored(commands, rid)
    assert chunks[0].choices[0].delta.role == "assistant" and all(c.id == f"chatcmpl-{rid}" for c in chunks)
    *body, finish, usage = chunks
    assert finish.choices[0].finish_reason == "length" and usage.choices == []
    assert usage.usage is not None and usage.usage.completion_tokens == 256
    assert all("usage" in c.model_fields_set and c.usage is None for c in [*body, finish])  # null until the last
    text = "".join(c.choices[0].delta.content or "" for c in [*body, finish])
    assert len(body) > 10  # one chunk per token that completed a character, not one block at the end
    assert text == stored["result"]["generation"]["text"]


def test_completion_stream_matches_the_non_streamed_text(client: openai.OpenAI) -> None:
    args: dict[str, Any] = {"model": "demo-lm", "prompt": "Once", "max_tokens": 20, "temperature": 0}
    whole = client.completions.create(**args, extra_body=NO_EOS)
    chunks = list(client.completions.create(**args, stream=True, extra_body=NO_EOS))
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert not any("usage" in c.model_fields_set for c in chunks)  # no usage asked for: none named


def test_disconnect_cancels_the_generation(served: Served) -> None:
    """The demo LM makes its 256 tokens in ~0.1 s, so on a loaded machine the generation can end before the
    disconnect reaches it: it runs to its length, and if the gateway read the stream's last event before the
    disconnect it writes no cancel mark at all. Such an attempt proves nothing either way and the test tries
    again. It passes only on a generation that the disconnect actually cut short, through the mark."""
    body = {"model": "demo-lm", "prompt": "Go on", "max_tokens": 256, "stream": True, "temperature": 0, **NO_EOS}
    endings = []
    for _attempt in range(3):
        with httpx.stream("POST", served.gateway.url + "/v1/completions", json=body, headers=AUTH, timeout=30) as resp:
            rid = resp.headers["x-request-id"]
            lines = resp.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
        # the connection is closed here, mid-stream
        gen = served.finished(rid)["result"]["generation"]
        marked = bool(served.redis.exists(CANCEL_KEY.format(id=rid)))
        endings.append((gen["finish_reason"], gen["usage"]["completion_tokens"], marked))
        if gen["finish_reason"] != "length":
            break
    assert endings[-1][0] == "cancelled" and endings[-1][1] < 256 and endings[-1][2], endings


def _cancel_marks(served: Served) -> set[str]:
    return {key.decode().rsplit(":", 1)[1] for key in served.redis.scan_iter(CANCEL_KEY.format(id="*"))}


def test_a_non_streaming_call_whose_client_leaves_cancels_its_request(served: Served) -> None:
    """plain-lm has no worker, so the call waits; the SDK gives up after 1 s and closes its connection. The
    gateway, watching for that while it waits, marks the request cancelled: a worker would never run it."""
    before = _cancel_marks(served)
    impatient = openai.OpenAI(base_url=served.base_url, api_key=API_KEY, max_retries=0, timeout=1.0)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(model="plain-lm", prompt="Hi", max_tokens=4)
    marked = wait_until(lambda: _cancel_marks(served) - before, 10, "the cancel mark")
    assert len(marked) == 1
    (rid,) = marked
    assert served.http.get(f"/v1/requests/{rid}").json()["status"] == "cancelled"
    # a call whose client stays gets its answer, and nothing is cancelled
    patient = openai.OpenAI(base_url=served.base_url, api_key=API_KEY, max_retries=0, timeout=60)
    raw = patient.completions.with_raw_response.create(model="demo-lm", prompt="Hi", max_tokens=4, extra_body=NO_EOS)
    assert raw.parse().choices[0].finish_reason == "length"
    assert raw.headers["x-request-id"] not in _cancel_marks(served)


def test_error_event_becomes_an_error_chunk_then_done(served: Served) -> None:
    """plain-lm has no worker: its request waits in the queue, and an error event written into its
    stream (what a worker writes when it refuses a request) reaches the client as OpenAI's error."""
    body = {"model": "plain-lm", "prompt": "Hi", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", served.gateway.url + "/v1/completions", json=body, headers=AUTH, timeout=30) as resp:
        assert resp.status_code == 200
        rid = resp.headers["x-request-id"]
        error = StreamEvent(type="error", index=0, error="RequestExpired", message="deadline passed", field="deadline")
        served.redis.xadd(STREAM_KEY.format(id=rid), encode_event(error))
        frames = _data_frames(list(resp.iter_lines()))
    assert frames[-1] == "[DONE]" and len(frames) == 2
    assert json.loads(frames[0])["error"] == {
        "message": "deadline passed", "type": "timeout_error", "param": "deadline", "code": "expired"
    }
    assert not served.redis.exists(CANCEL_KEY.format(id=rid))  # the stream ended: nothing to cancel


async def _one_stream(http: httpx.AsyncClient, i: int) -> tuple[int, str | None, bool, float]:
    body = {"model": "demo-lm", "prompt": f"stream {i}", "max_tokens": 4, "temperature": 0, "stream": True, **NO_EOS}
    started = time.monotonic()
    tokens, finish, done = 0, None, False
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            choice = json.loads(line[6:])["choices"][0]
            tokens += 1
            finish = choice["finish_reason"] or finish
    return tokens, finish, done, time.monotonic() - started


def test_200_concurrent_streams_through_one_gateway(served: Served) -> None:
    async def run() -> list[tuple[int, str | None, bool, float]]:
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=250)
        async with httpx.AsyncClient(base_url=served.gateway.url, headers=AUTH, limits=limits, timeout=120) as http:
            return await asyncio.gather(*(_one_stream(http, i) for i in range(200)))

    started = time.monotonic()
    outcomes = asyncio.run(run())
    wall_s = time.monotonic() - started
    assert all(done and finish == "length" and tokens >= 1 for tokens, finish, done, _ in outcomes), outcomes
    print(f"200 streams of 4 tokens: {wall_s:.1f} s wall, slowest {max(o[3] for o in outcomes):.1f} s")


def test_native_stream_of_a_native_generation(served: Served) -> None:
    http = served.http
    generation = {"max_new_tokens": 16, "ignore_eos": True}
    resp = http.post("/v1/requests", json={"model": "demo-lm", "text": "Hi", "output": {"generation": generation}})
    assert resp.status_code == 202, resp.text
    rid = resp.json()["request_id"]
    with http.stream("GET", f"/v1/requests/{rid}/stream") as sse:
        assert sse.headers["content-type"].startswith("text/event-stream"), (sse.status_code, sse.read())
        events = [json.loads(frame) for frame in _data_frames(list(sse.iter_lines()))]
    tokens = [e for e in events if e["type"] == "token"]
    assert [e["index"] for e in tokens] == list(range(16))
    assert events[-1]["type"] == "final" and events[-1]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 16
    text = "".join(e.get("text", "") for e in events)
    assert text == served.finished(rid)["result"]["generation"]["text"]
    again = http.get(f"/v1/requests/{rid}/stream")  # after the end: the whole stream again, at once
    assert _data_frames(again.text.splitlines()) == [json.dumps(e, separators=(",", ":")) for e in events]

    quiet = {"model": "demo-lm", "text": "Hi", "output": {"generation": {"max_new_tokens": 2, "stream": False}}}
    unstreamed = http.post("/v1/requests", json=quiet).json()["request_id"]
    served.finished(unstreamed)
    refused = http.get(f"/v1/requests/{unstreamed}/stream")
    assert refused.status_code == 409 and "no stream" in refused.json()["message"]
    plain = http.post("/v1/requests", json={"model": "demo-lm", "input_ids": [5, 6, 7]}).json()["request_id"]
    conflict = http.get(f"/v1/requests/{plain}/stream")
    assert conflict.status_code == 409 and "next_token" in conflict.json()["message"]
    assert http.get("/v1/requests/never-submitted/stream").status_code == 404
