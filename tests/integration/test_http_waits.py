"""What HTTP load clients and pollers need from a real gateway and worker: the request bodies guidellm
(vLLM's benchmark client) sends, byte for byte in shape (``stream_options.continuous_usage_stats``,
``max_completion_tokens``, ``stop: null``, ``ignore_eos``, content parts), its ``/health`` and
``/v1/models`` probes, the long-poll of ``GET /v1/requests/{id}?wait_s=`` (the result as soon as
it is stored; the status at the bound; a wait past ``api.max_wait_s`` refused naming the limit), and the
same wait on the submit itself (``POST /v1/requests?wait_s=`` or ``Prefer: wait=``: one exchange)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.integration.ops_fixtures import API_KEY, GatewayProcess, OpsFleet, ops_models, ops_redis
from tests.integration.redis_monitor import Monitor
from tools.redis_server import EmbeddedRedis

__all__ = ["ops_models", "ops_redis"]

MAX_WAIT_S = 120.0
"""The fleet's api.max_wait_s here: long enough for a worker to start on a loaded machine."""
LENGTH = 48
"""Forced generation length (guidellm's output_tokens with ignore_eos)."""


class Fleet:
    def __init__(self, ops: OpsFleet, config: Any, gateway: GatewayProcess, http: httpx.Client) -> None:
        self.ops, self.config, self.gateway, self.http = ops, config, gateway, http


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, ops_models: Any, ops_redis: EmbeddedRedis) -> Iterator[Fleet]:
    """demo-lm with a worker; later-lm (same file) whose worker a test starts; idle-lm never served."""
    ops = OpsFleet(tmp_path_factory.mktemp("waits"), ops_models, ops_redis)
    try:
        same = {"path": str(ops_models.lm), "limits": {"max_input_tokens": 64}, "engine": {"intra_op_threads": 1}}
        config = ops.config(serve=("demo-lm",), models={"later-lm": same, "idle-lm": same},
                            api={"max_wait_s": MAX_WAIT_S})  # fmt: skip
        ops.worker(config, "demo-lm")
        gateway = ops.gateway(config)
        with httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as http:
            yield Fleet(ops, config, gateway, http)
    finally:
        ops.close()


def _sse_payloads(http: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Every ``data:`` payload of a streamed call, up to ``[DONE]`` (which must end it)."""
    with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        frames = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    return [json.loads(f) for f in frames[:-1]]


def _guidellm_chat(stream_options: dict[str, bool]) -> dict[str, Any]:
    """guidellm's chat body for a synthetic prompt with forced output tokens."""
    return {
        "model": "demo-lm",
        "stream": True,
        "stream_options": stream_options,
        "max_completion_tokens": LENGTH,
        "stop": None,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "one two three four"}]}],
    }


def _check_continuous(chunks: list[dict[str, Any]]) -> None:
    """Usage on every chunk, never shrinking, ending at the forced length; then OpenAI's usage-only chunk."""
    assert all(c.get("usage") for c in chunks), [c for c in chunks if not c.get("usage")][:1]
    usages = [c["usage"] for c in chunks]
    prompt = usages[-1]["prompt_tokens"]
    assert prompt > 0 and all(u["prompt_tokens"] == prompt for u in usages)
    done = [u["completion_tokens"] for u in usages]
    assert done == sorted(done) and done[-1] == LENGTH and done[-2] == LENGTH
    assert all(u["total_tokens"] == prompt + u["completion_tokens"] for u in usages)
    assert chunks[-1]["choices"] == [] and chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert len({u["completion_tokens"] for u in usages}) > 2  # counts move with the tokens, not only at the end


def test_guidellm_chat_body_streams_usage_in_every_chunk(fleet: Fleet) -> None:
    assert fleet.http.get("/health").status_code == 200  # guidellm's start-up probe
    models = fleet.http.get("/v1/models").json()
    assert models["data"][0]["id"] == "demo-lm"  # guidellm benchmarks the first when none is named
    chunks = _sse_payloads(fleet.http, "/v1/chat/completions",
                           _guidellm_chat({"include_usage": True, "continuous_usage_stats": True}))  # fmt: skip
    _check_continuous(chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])


def test_guidellm_completion_body_streams_usage_in_every_chunk(fleet: Fleet) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"model": "demo-lm", "stream": True, "stream_options": options,
            "max_tokens": LENGTH, "stop": None, "ignore_eos": True, "prompt": "one two three four"}  # fmt: skip
    _check_continuous(_sse_payloads(fleet.http, "/v1/completions", body))


def test_include_usage_alone_keeps_openais_single_usage_chunk(fleet: Fleet) -> None:
    chunks = _sse_payloads(fleet.http, "/v1/chat/completions", _guidellm_chat({"include_usage": True}))
    assert [c for c in chunks if c.get("usage")] == [chunks[-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == LENGTH


def _submit(fleet: Fleet, model: str) -> str:
    body = {"model": model, "input_ids": [1, 2, 3], "output": {"kind": "generate", "generation": {"max_new_tokens": 4}}}
    accepted = fleet.http.post("/v1/requests", json=body)
    assert accepted.status_code == 202, accepted.text
    rid: str = accepted.json()["request_id"]
    return rid


def test_long_poll_answers_when_the_result_is_stored(fleet: Fleet) -> None:
    """The request waits for a worker that is not there yet; the long-poll is answered by the stored
    result once one starts (the old route answered ``queued`` at once)."""
    rid = _submit(fleet, "later-lm")
    with ThreadPoolExecutor(1) as pool:
        polled = pool.submit(fleet.http.get, f"/v1/requests/{rid}", params={"wait_s": MAX_WAIT_S},
                             timeout=MAX_WAIT_S + 30)  # fmt: skip
        assert not polled.done()  # no worker serves later-lm yet, and the bound is far away
        fleet.ops.worker(fleet.config, "later-lm")
        answer = polled.result(MAX_WAIT_S + 30)
    assert answer.status_code == 200, answer.text
    doc = answer.json()
    assert doc["status"] == "succeeded" and len(doc["result"]["generation"]["token_ids"]) == 4
    assert fleet.ops.redis.exists(f"celery-task-meta-{rid}")


def test_long_poll_bound_answers_the_current_status(fleet: Fleet) -> None:
    rid = _submit(fleet, "idle-lm")
    started = time.monotonic()
    answer = fleet.http.get(f"/v1/requests/{rid}", params={"wait_s": 1.5})
    waited_s = time.monotonic() - started
    assert answer.status_code == 200, answer.text
    doc = answer.json()
    assert doc["status"] == "queued" and "idle-lm" in doc["warning"]
    assert waited_s >= 1.5 * 0.9  # it held the call to the bound (no upper bound asserted: the machine is loaded)


def test_long_poll_past_the_limit_is_refused_naming_it(fleet: Fleet) -> None:
    rid = _submit(fleet, "idle-lm")
    answer = fleet.http.get(f"/v1/requests/{rid}", params={"wait_s": MAX_WAIT_S + 1})
    assert answer.status_code == 422
    doc = answer.json()
    assert doc["field"] == "wait_s" and doc["limit"] == MAX_WAIT_S and "api.max_wait_s" in doc["message"]
    negative = fleet.http.get(f"/v1/requests/{rid}", params={"wait_s": -1}).json()
    assert negative["field"] == "wait_s"


GENERATE = {"kind": "generate", "generation": {"max_new_tokens": 4}}


def test_submit_with_wait_answers_the_result_in_one_exchange(fleet: Fleet) -> None:
    """``?wait_s=`` and ``Prefer: wait`` (RFC 7240) on the submit: 200 with the view GET answers, and its
    Location; a preference past ``api.max_wait_s`` is cut to it and ``Preference-Applied`` says so.
    Before, both were ignored: 202 and a GET to follow."""
    body = {"model": "demo-lm", "input_ids": [1, 2, 3], "output": GENERATE}
    by_query = fleet.http.post("/v1/requests", json=body, params={"wait_s": MAX_WAIT_S}, timeout=MAX_WAIT_S + 30)
    by_header = fleet.http.post("/v1/requests", json=body, headers={"Prefer": f"respond-async, wait={10 * MAX_WAIT_S}"},
                                timeout=MAX_WAIT_S + 30)  # fmt: skip
    for answer in (by_query, by_header):
        assert answer.status_code == 200, answer.text
        doc = answer.json()
        assert doc["status"] == "succeeded" and len(doc["result"]["generation"]["token_ids"]) == 4
        assert answer.headers["Location"] == f"/v1/requests/{doc['request_id']}"
        assert fleet.http.get(answer.headers["Location"]).json() == doc  # the same view GET answers
    assert "Preference-Applied" not in by_query.headers
    assert by_header.headers["Preference-Applied"] == f"wait={MAX_WAIT_S:g}"
    next_token = {"model": "demo-lm", "input_ids": [5, 6], "output": {"kind": "next_token"}}
    one_step = fleet.http.post("/v1/requests", json=next_token, params={"wait_s": MAX_WAIT_S}, timeout=MAX_WAIT_S + 30)
    assert one_step.status_code == 200 and one_step.json()["result"]["top_k"], one_step.text


def test_a_submit_wait_is_subscribed_before_the_request_is_queued(fleet: Fleet) -> None:
    """``POST ?wait_s=`` with a new ID subscribes its result channel before the request is queued, so nothing
    can be stored unheard and the key is not read first (before: queued, then subscribed, then read). Read
    off Redis's own MONITOR, up to a marker command sent after the answer."""
    monitor = Monitor(fleet.ops.redis_url)
    try:
        answer = fleet.http.post("/v1/requests", json={"model": "idle-lm", "input_ids": [1, 2, 3]},
                                 params={"wait_s": 0.2})  # fmt: skip
        assert answer.status_code == 202, answer.text
        rid = answer.json()["request_id"]
        commands = [c["command"] for c in monitor.up_to_now()]
    finally:
        monitor.close()
    key = f"celery-task-meta-{rid}"
    subscribed = next(i for i, c in enumerate(commands) if c.startswith("SUBSCRIBE") and key in c)
    queued = next(i for i, c in enumerate(commands) if rid in c and key not in c)  # the submit script
    assert subscribed < queued, commands[subscribed - 2 : queued + 2]
    reads = [c for c in commands if c.split(" ", 1)[0] in ("GET", "MGET") and key in c]
    # the backstop's read at the bound (none if the loop was held past it) and the status read of the 202;
    # before, a read right after the subscription made three
    assert 1 <= len(reads) <= 2, reads


def test_submit_wait_bound_answers_202_with_the_status_then(fleet: Fleet) -> None:
    body = {"model": "idle-lm", "input_ids": [1, 2, 3], "output": GENERATE}
    started = time.monotonic()
    answer = fleet.http.post("/v1/requests", json=body, headers={"Prefer": "wait=1.5"})
    waited_s = time.monotonic() - started
    assert answer.status_code == 202, answer.text
    doc = answer.json()
    assert doc["status"] == "queued" and "idle-lm" in doc["warning"] and answer.headers["Location"] == doc["location"]
    assert answer.headers["Preference-Applied"] == "wait=1.5"
    assert waited_s >= 1.5 * 0.9  # it held the call to the bound (no upper bound asserted: the machine is loaded)
    unreadable = fleet.http.post("/v1/requests", json=body, headers={"Prefer": "wait=soon"})
    assert unreadable.status_code == 202 and "Preference-Applied" not in unreadable.headers  # a hint: ignored


def test_submit_wait_past_the_limit_is_refused_naming_it_and_queues_nothing(fleet: Fleet) -> None:
    rid = "submit-wait-over-the-limit"
    body = {"model": "idle-lm", "input_ids": [1, 2, 3], "request_id": rid}
    answer = fleet.http.post("/v1/requests", json=body, params={"wait_s": MAX_WAIT_S + 1})
    assert answer.status_code == 422
    doc = answer.json()
    assert doc["field"] == "wait_s" and doc["limit"] == MAX_WAIT_S and "api.max_wait_s" in doc["message"]
    assert fleet.http.get(f"/v1/requests/{rid}").status_code == 404  # refused before anything was queued
    assert fleet.http.post("/v1/requests", json=body, params={"wait_s": -1}).json()["field"] == "wait_s"
