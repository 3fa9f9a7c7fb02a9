"""A JSON body whose object holds one key twice is refused with a 400 naming the key's path, at any depth, on the
native and the OpenAI routes (each in its own error shape), before anything is queued: a real gateway process,
real workers, real Redis.

Reported: ``{"model": "a", "model": "b"}`` was accepted (Python keeps the last value); a proxy or WAF in front
that keeps the first judged, logged or routed another request than the one the fleet served.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import pytest

from tests.integration.openai_fixtures import API_KEY, Served, ops_models, ops_redis, served

__all__ = ["ops_models", "ops_redis", "served"]

pytestmark = pytest.mark.timeout(240)

JSON = {"Content-Type": "application/json"}


def _post(served: Served, path: str, body: str) -> tuple[int, dict[str, Any]]:
    answer = served.http.post(path, content=body.encode(), headers=JSON)
    doc: dict[str, Any] = answer.json()
    return answer.status_code, doc


def test_a_native_request_with_a_repeated_key_is_refused_and_not_queued(served: Served) -> None:
    rid = f"dup-{uuid.uuid4().hex}"
    body = f'{{"model": "demo-lm", "input_ids": [5, 6], "model": "demo-encoder", "request_id": "{rid}"}}'
    status, doc = _post(served, "/v1/requests", body)
    assert status == 400, doc
    assert (doc["error"], doc["type"], doc["field"], doc["limit"]) == ("duplicate_key", "DuplicateKey", "model", 1)
    assert "'model'" in doc["message"], doc
    assert served.http.get(f"/v1/requests/{rid}").status_code == 404  # never queued


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/requests:batch", '{"requests": [{"model": "demo-lm", "input_ids": [5]}, '
                               '{"model": "demo-lm", "input_ids": [5], "input_ids": [6]}]}', "requests[1].input_ids"),
        ("/v1/requests", '{"model": "demo-lm", "input_ids": [5], "output": {"kind": "generate", "generation": '
                         '{"max_new_tokens": 2, "max_new_t\\u006fkens": 3}}}', "output.generation.max_new_tokens"),
    ],
)  # fmt: skip
def test_the_path_is_named_at_any_depth_on_native_routes(served: Served, path: str, body: str, field: str) -> None:
    status, doc = _post(served, path, body)
    assert status == 400 and doc["error"] == "duplicate_key" and doc["field"] == field, doc


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", '{"model": "demo-lm", "max_tokens": 2, "messages": '
                                 '[{"role": "user", "content": "Hi", "role": "system"}]}', "messages[0].role"),
        ("/v1/embeddings", '{"model": "demo-encoder", "input": "a", "m\\u006fdel": "demo-lm"}', "model"),
        ("/v1/responses", '{"model": "demo-lm", "input": "Hi", "input": "Bye", "max_output_tokens": 2}', "input"),
        ("/v1/completions", '{"model": "demo-lm", "prompt": "Hi", "max_tokens": 2, "max_tokens": 200}', "max_tokens"),
    ],
)  # fmt: skip
def test_openai_routes_refuse_in_their_shape(served: Served, path: str, body: str, param: str) -> None:
    json.loads(body)  # Python reads it (the last value wins): only the repeat is wrong
    status, doc = _post(served, path, body)
    assert status == 400, doc
    error = doc["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "duplicate_key", param), doc
    assert repr(param) in error["message"], doc


def test_the_same_key_in_sibling_objects_is_fine(served: Served) -> None:
    body = ('{"model": "demo-lm", "max_tokens": 2, "temperature": 0, "messages": '
            '[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}')  # fmt: skip
    status, doc = _post(served, "/v1/chat/completions", body)
    assert status == 200, doc
    assert doc["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize(
    ("path", "query", "name"),
    [
        ("/v1/requests/{rid}", "wait_s=0&wait_s=60", "wait_s"),
        ("/v1/requests/{rid}", "wait_s=0&wait%5Fs=60", "wait_s"),  # the name as the route decodes it
        ("/v1/responses/resp_x/input_items", "limit=1&limit=100", "limit"),
    ],
)
def test_a_query_parameter_given_twice_is_refused_naming_it(served: Served, path: str, query: str, name: str) -> None:
    rid = served.http.post("/v1/requests", json={"model": "demo-lm", "input_ids": [5, 6]}).json()["request_id"]
    answer = served.http.get(f"{path.format(rid=rid)}?{query}")
    doc = answer.json()
    assert answer.status_code == 400, doc
    if path.startswith("/v1/responses"):  # OpenAI's shape
        assert (doc["error"]["code"], doc["error"]["param"]) == ("duplicate_query_parameter", name), doc
    else:
        assert (doc["error"], doc["field"], doc["limit"]) == ("duplicate_query_parameter", name, 1), doc
    assert served.http.get(f"{path.format(rid=rid)}?{query.split('&')[0]}").status_code != 400  # once is fine


@pytest.mark.parametrize(("headers", "said"), [
    ([("X-API-Key", API_KEY), ("X-API-Key", "another-key")], "header X-API-Key is given 2 times"),
    ([("Authorization", f"Bearer {API_KEY}"), ("Authorization", "Bearer another-key")],
     "header Authorization is given 2 times"),
    ([("X-API-Key", "another-key"), ("Authorization", f"Bearer {API_KEY}")],
     "headers X-API-Key and Authorization name different keys"),
])
def test_credentials_given_twice_or_two_different_ways_are_refused(served: Served, headers: list[tuple[str, str]],
                                                                   said: str) -> None:  # fmt: skip
    """The first of two headers, and X-API-Key over Authorization, decided the key: a proxy in front that
    checked the other one would let a request through on one key that the gateway served under the other."""
    with httpx.Client(base_url=served.gateway.url, timeout=30) as http:
        for path in ("/v1/models", "/v1/requests/any-id"):
            answer = http.get(path, headers=headers)
            assert answer.status_code == 400, answer.text
            assert said in answer.text and "duplicate_credentials" in answer.text, answer.text
        same = http.get("/v1/models", headers=[("X-API-Key", API_KEY), ("Authorization", f"Bearer {API_KEY}")])
        assert same.status_code == 200, same.text  # one key, said both ways: not ambiguous
