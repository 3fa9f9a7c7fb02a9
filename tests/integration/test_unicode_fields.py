"""A lone surrogate (JSON's ``"\\ud800"``) in any caller string of any face is refused before anything runs:
400 on the OpenAI and Responses routes, 422 on the native ones, naming the field as sent and the character;
nothing queued, nothing stored (a stored one answered 500 to every later GET), and a canary split never
hashes it. Raw JSON bodies against a real ``fleet api`` process, a demo-lm worker and real Redis."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from protocol.keys import RESPONSE_KEY
from protocol.model_state import STATE_KEY, ModelState
from tests.integration.openai_fixtures import Served, ops_models, ops_redis, served
from tests.integration.ops_fixtures import API_KEY
from tests.unit.test_utf8_fields import M, put_text  # M: where a case's body gets the lone surrogate

__all__ = ["ops_models", "ops_redis", "served"]

CHAT = {"model": "demo-lm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": "demo-lm", "prompt": "hi", "max_tokens": 2}
RESP = {"model": "demo-lm", "input": "hi", "max_output_tokens": 4}
NATIVE = {"model": "demo-lm", "input_ids": [5, 6]}

OPENAI_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/responses", {**RESP, "metadata": {"k": M}}, "metadata.k"),
    ("/v1/responses", {**RESP, "metadata": {M: "v"}}, "metadata"),
    ("/v1/responses", {**RESP, "user": M}, "user"),
    ("/v1/responses", {**RESP, "instructions": M}, "instructions"),
    ("/v1/responses", {**RESP, "input": M}, "input"),
    ("/v1/responses", {**RESP, "input": [{"role": "user", "content": M}]}, "input[0].content"),
    ("/v1/responses", {**RESP, "previous_response_id": M}, "previous_response_id"),
    ("/v1/responses", {**RESP, "model": M}, "model"),
    ("/v1/responses", {**RESP, "text": {"format": {"type": "text"}, "verbosity": M}}, "text"),
    ("/v1/chat/completions", {**CHAT, "user": M}, "user"),
    ("/v1/chat/completions", {**CHAT, "stop": M}, "stop"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi", "name": M}]},
     "messages[0].name"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": M}]}]},
     "messages[0].content[0].text"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "text", "x": M}}, "response_format"),
    ("/v1/completions", {**COMPLETION, "user": M, "stream": True}, "user"),
    ("/v1/completions", {**COMPLETION, "stop": ["ok", M]}, "stop[1]"),
    ("/v1/completions", {**COMPLETION, "prompt": [M]}, "prompt[0]"),
    ("/v1/embeddings", {"model": "demo-encoder", "input": "hi", "user": M}, "user"),
]
NATIVE_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/requests", {**NATIVE, "routing_key": M}, "routing_key"),
    ("/v1/requests", {**NATIVE, "request_id": M}, "request_id"),
    ("/v1/requests", {**NATIVE, "model": M}, "model"),
    ("/v1/requests", {"model": "demo-lm", "text": M}, "text"),
    ("/v1/requests", {**NATIVE, "output": {"generation": {"stop": [M], "max_new_tokens": 2}}},
     "output.generation.stop[0]"),
    ("/v1/requests:batch", {"requests": [NATIVE, {**NATIVE, "routing_key": M}]}, "requests[1].routing_key"),
]


def _post(served: Served, path: str, body: Any) -> Any:
    """``body`` as raw JSON: ``json.dumps`` writes a lone surrogate as the ``\\ud800`` escape a client sends."""
    return served.http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def _kept(served: Served) -> set[bytes]:
    """What a request or a stored response leaves in Redis."""
    return set(served.redis.scan_iter(match="fleet:req:*")) | set(served.redis.scan_iter(match="fleet:response:*"))


def _refused(served: Served, path: str, body: dict[str, Any], lone: str, at: int) -> dict[str, Any]:
    """Post ``body`` with ``lone`` at the mark (``at`` characters in); assert nothing was kept; the error."""
    before = _kept(served)
    answer = _post(served, path, put_text(body, "ab"[:at] + lone))
    assert _kept(served) == before  # nothing queued, nothing stored
    native = path.startswith("/v1/requests")
    assert answer.status_code == (422 if native else 400), answer.text
    error: dict[str, Any] = answer.json() if native else answer.json()["error"]
    assert f"not valid Unicode: lone surrogate U+{ord(lone):04X} at character {at}" in error["message"], error
    return error


@pytest.mark.parametrize(("path", "body", "field"), OPENAI_CASES, ids=[f"{p}-{f}" for p, _, f in OPENAI_CASES])
def test_openai_faces_refuse_a_lone_surrogate_naming_the_field(
    served: Served, path: str, body: dict[str, Any], field: str
) -> None:
    error = _refused(served, path, body, "\ud800", 2)
    assert (error["param"], error["code"], error["type"]) == (field, "invalid_request", "invalid_request_error")


@pytest.mark.parametrize(("path", "body", "field"), NATIVE_CASES, ids=[f"{p}-{f}" for p, _, f in NATIVE_CASES])
def test_native_face_refuses_a_lone_surrogate_naming_the_field(
    served: Served, path: str, body: dict[str, Any], field: str
) -> None:
    error = _refused(served, path, body, "\udfff", 1)
    assert (error["field"], error["type"]) == (field, "InvalidRequest")


def test_instructions_are_named_with_the_offset_in_them(served: Served) -> None:
    body = {**RESP, "input": "a long enough input", "instructions": "Be brief.\ud800"}
    error = _post(served, "/v1/responses", body).json()["error"]
    assert error["param"] == "instructions" and "U+D800 at character 9 " in error["message"], error


def test_a_surrogate_pair_is_stored_and_served_back(served: Served) -> None:
    """A pair (``\\ud83d\\ude42``) is one character, 🙂: it is no lone surrogate and works everywhere."""
    answer = _post(served, "/v1/responses", {**RESP, "user": "\U0001f642", "metadata": {"\U0001f642": "\U0001f642"}})
    assert answer.status_code == 200, answer.text
    stored = served.http.get(f"/v1/responses/{answer.json()['id']}")
    assert stored.status_code == 200, stored.text
    assert (stored.json()["user"], stored.json()["metadata"]) == ("\U0001f642", {"\U0001f642": "\U0001f642"})


def test_a_response_stored_with_a_lone_surrogate_before_the_check_is_served_mended(served: Served) -> None:
    """A response stored before the edge refused lone surrogates (``user`` and an input item holding one,
    written as ``json.dumps`` wrote them then) is served with U+FFFD in their place; before, every GET
    answered 500 until the response expired."""
    answer = _post(served, "/v1/responses", {**RESP, "user": "u"})
    assert answer.status_code == 200, answer.text
    key = RESPONSE_KEY.format(id=answer.json()["id"])
    doc = json.loads(served.redis.get(key) or b"{}")
    doc["response"]["user"] = "u\ud800"
    doc["input_items"][0]["content"][0]["text"] = "h\udfffi"
    served.redis.set(key, json.dumps(doc), keepttl=True)  # ensure_ascii: the escapes, as stored then

    stored = served.http.get(f"/v1/responses/{answer.json()['id']}")
    assert stored.status_code == 200, stored.text
    assert stored.json()["user"] == "u\ufffd"
    items = served.http.get(f"/v1/responses/{answer.json()['id']}/input_items")
    assert items.status_code == 200, items.text
    assert items.json()["data"][0]["content"][0]["text"] == "h\ufffdi"


def test_a_canary_split_never_hashes_a_lone_surrogate(served: Served) -> None:
    """With a canary in force the routing key (``user``) is hashed: a lone surrogate is refused first (a
    gateway started after the split, so it routes by it from its first request)."""
    state = ModelState(model="demo-lm", stable="1.0.0", canary="2.0.0", canary_weight=50)
    served.redis.set(STATE_KEY.format(model="demo-lm"), state.model_dump_json())
    try:
        gateway = served.fleet.gateway(served.fleet.config())
        with httpx.Client(base_url=gateway.url, headers={"X-API-Key": API_KEY}, timeout=30) as http:
            canary = Served(served.fleet, gateway, http, served.redis)
            error = _refused(canary, "/v1/chat/completions", {**CHAT, "user": M}, "\ud800", 0)
            assert error["param"] == "user"
            error = _refused(canary, "/v1/completions", {**COMPLETION, "user": M, "stream": True}, "\udfff", 0)
            assert error["param"] == "user"
    finally:
        served.redis.delete(STATE_KEY.format(model="demo-lm"))
