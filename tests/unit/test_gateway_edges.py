"""The gateway's answers that are pure app logic, through starlette's TestClient on a gateway whose Redis is not
there (nothing here reaches it): paths that are no route, query values refused before any Redis step, and
``/readyz`` on settings that configure no model.

Reported: ``POST /v1/chat/completions/`` and ``GET /v1/models/`` were a bare ``307`` (Starlette's
``redirect_slashes``: a client that follows it may drop the POST's body); ``GET /v1`` and ``//v1/models`` answered
in the native error shape, though every ``/v1`` path but ``/v1/requests`` answers in OpenAI's; ``wait_s=1_0``
(pydantic read 10), ``wait_s=+1`` and ``wait_s=-0`` were taken; ``POST /v1/requests:batch?wait_s=5`` was a 202 that
had not waited; ``/readyz`` with no model configured answered 200 (every one of no models has a ready worker).
The same on a real gateway and Redis: ``tests/integration/test_gateway_edges_served.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from gateway.app import create_app
from gateway.ops_routes import NO_MODELS_PROBLEM
from protocol.settings import FleetSettings

KEY = "test-key-1"
AUTH = {"X-API-Key": KEY}
NO_REDIS = "redis://127.0.0.1:1/0"
"""A Redis URL nothing answers: a test that reached Redis would get a 503, not the answer it checks."""
GENERATION = {"model": "m", "input_ids": [5, 6]}


@pytest.fixture(scope="module")
def http() -> Iterator[TestClient]:
    settings = FleetSettings(redis_url=NO_REDIS, api={"api_keys": [KEY]})  # type: ignore[arg-type]
    with TestClient(create_app(settings), base_url="http://testserver", headers=AUTH) as client:
        yield client


def _openai_404(answer: Any) -> dict[str, Any]:
    assert answer.status_code == 404 and "location" not in answer.headers, (answer.status_code, answer.headers)
    error: dict[str, Any] = answer.json()["error"]
    assert isinstance(error, dict) and error["code"] == "not_found", answer.text
    return error


@pytest.mark.parametrize(("method", "path", "route"), [("POST", "/v1/chat/completions/", "/v1/chat/completions"),
                                                       ("POST", "/v1/completions/", "/v1/completions"),
                                                       ("POST", "/v1/embeddings/", "/v1/embeddings"),
                                                       ("GET", "/v1/models/", "/v1/models"),
                                                       ("GET", "/v1/models//", "/v1/models"),
                                                       ("POST", "/v1//chat/completions", "/v1/chat/completions")])
def test_a_trailing_slash_is_a_404_naming_the_route_never_a_redirect(
    http: TestClient, method: str, path: str, route: str
) -> None:
    answer = http.request(method, path, json={"model": "m", "prompt": "hi"} if method == "POST" else None,
                          follow_redirects=False)  # fmt: skip
    error = _openai_404(answer)
    assert error["type"] == "invalid_request_error" and f"the route is {route} " in error["message"], error


@pytest.mark.parametrize("path", ["/v1", "/v1/", "/v1/files", "//v1/models", "//v1/chat/completions", "///v1"])
def test_every_v1_path_but_the_native_ones_answers_in_openais_shape(http: TestClient, path: str) -> None:
    _openai_404(http.get("http://testserver" + path, follow_redirects=False))  # a path of "//" is not a host's


@pytest.mark.parametrize("path", ["//v1/requests/abc/x", "/v1/requests/abc/x/", "/healthz/", "/readyz/", "/nope"])
def test_the_native_namespace_answers_its_own_404(http: TestClient, path: str) -> None:
    answer = http.get("http://testserver" + path, follow_redirects=False)
    assert answer.status_code == 404 and "location" not in answer.headers, (answer.status_code, answer.headers)
    assert answer.json()["error"] == "not_found" and answer.json()["type"] == "HTTPError", answer.text


@pytest.mark.parametrize("path", ["/v1", "//v1/models", "//v1/requests/abc"])
def test_the_v1_namespace_needs_a_key_whatever_its_slashes(http: TestClient, path: str) -> None:
    answer = http.get("http://testserver" + path, headers={"X-API-Key": ""})
    assert answer.status_code == 401, answer.text


@pytest.mark.parametrize("value", ["1_0", "+1", "-0", "nan", "inf", " 1e1", "1e1", "١٠"])
@pytest.mark.parametrize(("method", "path"), [("POST", "/v1/requests"), ("GET", "/v1/requests/abc")])
def test_a_wait_s_that_is_not_digits_is_refused_naming_it(http: TestClient, method: str, path: str, value: str) -> None:
    answer = http.request(method, path, params={"wait_s": value}, json=GENERATION if method == "POST" else None)
    assert answer.status_code == 422 and answer.json()["field"] == "wait_s", answer.text
    assert "digits with an optional decimal fraction" in answer.json()["message"], answer.text


@pytest.mark.parametrize("value", ["1_0", "+5", " 5"])
def test_a_responses_limit_that_is_not_digits_is_refused_naming_it(http: TestClient, value: str) -> None:
    answer = http.get("/v1/responses/resp_abc/input_items", params={"limit": value})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "limit", answer.text


@pytest.mark.parametrize("query", ["wait_s=5", "wait_s=", "wait_s=0"])
def test_a_batch_refuses_wait_s_and_says_where_to_wait(http: TestClient, query: str) -> None:
    answer = http.post(f"/v1/requests:batch?{query}", json={"requests": [GENERATION]})
    assert answer.status_code == 422, answer.text
    body = answer.json()
    assert body["field"] == "wait_s" and "GET /v1/requests/{id}?wait_s=" in body["message"], body


def test_readyz_with_no_model_configured_is_503_saying_so() -> None:
    """Before: no Redis read answered the Redis problem; with Redis up it answered 200 (integration test)."""
    with TestClient(create_app(FleetSettings(redis_url=NO_REDIS))) as http:
        for answer in (http.get("/readyz"), http.head("/readyz")):
            assert answer.status_code == 503, answer.text
        assert http.get("/readyz").json() == {"ready": False, "problems": [NO_MODELS_PROBLEM]}
        named = http.get("/readyz", params={"model": "m"})  # a model asked for by name: said as before
        assert named.status_code == 503 and named.json()["problems"] != [NO_MODELS_PROBLEM], named.text
