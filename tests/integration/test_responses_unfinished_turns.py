"""Responses turns that have not ended well, as ``previous_response_id``: one cancelled mid-way by another caller
(``DELETE /v1/requests/{id}``, ``fleet cancel``) is answered as ``cancelled`` and not stored, so no later turn
continues from its half answer; one still running is refused as such (the official ``openai`` SDK against a real
gateway, worker and Redis).

Reported: the turn's generation ended with ``finish_reason`` ``cancelled``, yet the stream ended with
``response.completed`` (a non-streamed call answered ``status: "completed"``) and the cut text was stored as the
assistant's whole reply: ``previous_response_id`` continued the conversation from it as if it were finished. And a
turn that named a response still being generated got a 404 saying it was "never stored, deleted, or older than
api.responses_ttl_s".
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from protocol.keys import REQUEST_KEY
from tests.integration.openai_fixtures import API_KEY, ops_models, ops_redis
from tests.integration.ops_fixtures import OpsFleet, wait_until
from tools.build_llama import build_llama
from tools.redis_server import EmbeddedRedis

__all__ = ["ops_models", "ops_redis"]

MODEL = "slow-lm"
LONG_TURN_TOKENS = 1000
"""New tokens asked of the turn that is cancelled: seconds of decoding, so the cancel lands mid-turn."""
TURN: dict[str, Any] = {"model": MODEL, "temperature": 0}


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, ops_models: Any, ops_redis: EmbeddedRedis
) -> Iterator[tuple[openai.OpenAI, httpx.Client, OpsFleet]]:
    """A deeper, wider demo decoder (byte tokenizer, chat template) with one worker and one gateway."""
    root = tmp_path_factory.mktemp("cancelled-turns")
    path: Path = build_llama(root, hidden_size=256, num_layers=6, max_positions=LONG_TURN_TOKENS + 256)
    fleet = OpsFleet(root, ops_models, ops_redis)
    try:
        config = fleet.config(serve=(), worker={"model": MODEL},
                              models={MODEL: {"path": str(path), "engine": {"intra_op_threads": 1},
                                              "limits": {"max_input_tokens": 512,
                                                         "max_new_tokens": LONG_TURN_TOKENS}}})  # fmt: skip
        fleet.worker(config, MODEL)
        gateway = fleet.gateway(config)
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        with httpx.Client(base_url=gateway.url, headers={"X-API-Key": API_KEY}, timeout=120) as http:
            yield client, http, fleet
    finally:
        fleet.close()


def _generation(http: httpx.Client, rid: str) -> dict[str, Any]:
    generation: dict[str, Any] = http.get(f"/v1/requests/{rid}").json()["result"]["generation"]
    return generation


def _not_continued(client: openai.OpenAI, http: httpx.Client, response_id: str) -> None:
    """Neither retrievable nor a conversation to continue."""
    assert http.get(f"/v1/responses/{response_id}").status_code == 404
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(previous_response_id=response_id, input="Go on", max_output_tokens=4, **TURN)
    assert info.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_a_streamed_turn_cancelled_by_another_caller_ends_in_an_error_and_is_not_stored(
    served: tuple[openai.OpenAI, httpx.Client, OpsFleet],
) -> None:
    client, http, _ = served
    first = client.responses.create(input="Hi", max_output_tokens=4, **TURN)
    events: list[Any] = []
    rid = ""
    for event in client.responses.create(previous_response_id=first.id, input="go", stream=True,
                                         max_output_tokens=LONG_TURN_TOKENS, **TURN):  # fmt: skip
        events.append(event)
        if event.type == "response.created":
            rid = event.response.id.removeprefix("resp_")
        if event.type == "response.output_text.delta" and sum(e.type == event.type for e in events) == 1:
            assert http.delete(f"/v1/requests/{rid}").status_code == 200  # another caller cancels it mid-turn
    assert _generation(http, rid)["finish_reason"] == "cancelled"
    last = events[-1]
    assert (last.type, getattr(last, "code", None)) == ("error", "cancelled"), last
    assert not any(e.type in ("response.completed", "response.incomplete") for e in events)
    _not_continued(client, http, f"resp_{rid}")


def test_a_turn_cancelled_by_another_caller_is_answered_cancelled_and_is_not_stored(
    served: tuple[openai.OpenAI, httpx.Client, OpsFleet],
) -> None:
    client, http, fleet = served
    first = client.responses.create(input="Hi", max_output_tokens=4, **TURN)
    before = set(fleet.redis.scan_iter(REQUEST_KEY.format(id="*")))
    answered: list[Any] = []

    def create() -> None:
        answered.append(client.responses.create(previous_response_id=first.id, input="go",
                                                max_output_tokens=LONG_TURN_TOKENS, **TURN))  # fmt: skip

    caller = threading.Thread(target=create)
    caller.start()
    try:
        key = wait_until(lambda: next(iter(set(fleet.redis.scan_iter(REQUEST_KEY.format(id="*"))) - before), None),
                         30, "the turn to be queued")  # fmt: skip
        rid = key.decode().removeprefix(REQUEST_KEY.format(id=""))
        wait_until(lambda: http.get(f"/v1/requests/{rid}").json()["status"] == "running", 60, "the turn to run")
        assert http.delete(f"/v1/requests/{rid}").status_code == 200
    finally:
        caller.join(120)
    assert _generation(http, rid)["finish_reason"] == "cancelled"
    [response] = answered
    assert response.id == f"resp_{rid}"
    assert response.status == "cancelled" and response.output[0].status == "incomplete"
    _not_continued(client, http, response.id)


def test_a_response_still_being_generated_is_refused_as_in_progress_then_continues(
    served: tuple[openai.OpenAI, httpx.Client, OpsFleet],
) -> None:
    client = served[0]
    refused: list[openai.APIStatusError] = []
    ended: list[Any] = []
    response_id = ""
    for event in client.responses.create(input="go", stream=True, max_output_tokens=256, **TURN):
        if event.type == "response.created":
            response_id = event.response.id
        if event.type == "response.output_text.delta" and not refused:  # running: its first tokens are out
            with pytest.raises(openai.BadRequestError) as info:
                client.responses.create(previous_response_id=response_id, input="Go on", max_output_tokens=4, **TURN)
            refused.append(info.value)
        if event.type in ("response.completed", "response.incomplete"):
            ended.append(event.response)
    body: Any = refused[0].body
    assert body["param"] == "previous_response_id" and "still running" in body["message"], body
    [done] = ended
    after = client.responses.create(previous_response_id=done.id, input="Go on", max_output_tokens=4, **TURN)
    assert after.previous_response_id == done.id
