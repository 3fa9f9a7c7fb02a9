"""A stored ``/v1/responses`` response belongs to the API key that created it: the official ``openai`` SDK, two
clients with two keys, against a real gateway process, a real demo-lm worker and real Redis.

Reported: any accepted key could read (``GET``, ``input_items``), delete, or continue (``previous_response_id``)
a conversation another key created, given its ID. Now another key is answered the 404 of an unknown ID (the
same body, so existence does not leak), a turn still queued included, and Redis holds a keyed digest of the
owner's key, never the key.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from protocol.keys import RESPONSE_KEY
from tests.integration.openai_fixtures import ops_models, ops_redis
from tests.integration.ops_fixtures import OpsFleet, wait_until
from tools.redis_server import EmbeddedRedis

__all__ = ["ops_models", "ops_redis"]

pytestmark = pytest.mark.timeout(300)

KEY_A = "scoped-key-a"
KEY_B = "scoped-key-b"
GREEDY: dict[str, Any] = {"model": "demo-lm", "max_output_tokens": 4, "temperature": 0}
IDLE = "idle-lm"
"""The demo LM under another name that no worker serves: a turn for it stays queued while its stream is open."""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, ops_models: Any, ops_redis: EmbeddedRedis) -> Iterator[OpsFleet]:
    """One gateway with two keys, one demo-lm worker; ``idle-lm`` has none (a call waits up to 600 s for one)."""
    fleet = OpsFleet(tmp_path_factory.mktemp("scoped"), ops_models, ops_redis)
    try:
        limits = {"limits": {"max_input_tokens": 384}}
        models = {"demo-lm": limits, IDLE: {"path": str(ops_models.lm), **limits}}
        config = fleet.config(serve=("demo-lm",), models=models,
                              api={"api_keys": [KEY_A, KEY_B], "no_worker_wait_s": 600})  # fmt: skip
        fleet.worker(config, "demo-lm")
        fleet.gateway(config)
        yield fleet
    finally:
        fleet.close()


@pytest.fixture(scope="module")
def clients(fleet: OpsFleet) -> tuple[openai.OpenAI, openai.OpenAI]:
    """Client a (key a) and client b (key b), on the same gateway."""
    url = fleet.gateways[0].url + "/v1"
    a, b = (openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60) for key in (KEY_A, KEY_B))
    return a, b


def _not_found(call: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """The 404 body ``call`` is answered with."""
    with pytest.raises(openai.NotFoundError) as info:
        call(*args, **kwargs)
    body: dict[str, Any] = info.value.body  # type: ignore[assignment]
    return body


def _as_unknown(body: dict[str, Any], response_id: str, unknown_id: str) -> dict[str, Any]:
    """``body`` with ``response_id`` written as ``unknown_id``: equal to an unknown ID's 404 when nothing leaks."""
    return {k: v.replace(response_id, unknown_id) if isinstance(v, str) else v for k, v in body.items()}


def test_another_key_is_told_a_response_does_not_exist(
    fleet: OpsFleet, clients: tuple[openai.OpenAI, openai.OpenAI]
) -> None:
    a, b = clients
    first = a.responses.create(input="Hi", **GREEDY)
    unknown = f"resp_{uuid.uuid4().hex}"

    refused = _not_found(b.responses.retrieve, first.id)
    assert _as_unknown(refused, first.id, unknown) == _not_found(b.responses.retrieve, unknown), refused
    refused = _not_found(b.responses.input_items.list, first.id)
    assert _as_unknown(refused, first.id, unknown) == _not_found(b.responses.input_items.list, unknown), refused
    refused = _not_found(b.responses.delete, first.id)
    assert _as_unknown(refused, first.id, unknown) == _not_found(b.responses.delete, unknown), refused
    refused = _not_found(b.responses.create, previous_response_id=first.id, input="More", **GREEDY)
    assert refused["param"] == "previous_response_id", refused
    assert _as_unknown(refused, first.id, unknown) == _not_found(
        b.responses.create, previous_response_id=unknown, input="More", **GREEDY
    ), refused

    # b's refused DELETE deleted nothing: a still reads, lists and continues its conversation
    assert a.responses.retrieve(first.id).output_text == first.output_text
    assert [getattr(item, "role", None) for item in a.responses.input_items.list(first.id).data] == ["user"]
    second = a.responses.create(previous_response_id=first.id, input="More", **GREEDY)
    assert second.previous_response_id == first.id
    raw = fleet.redis.get(RESPONSE_KEY.format(id=second.id))
    assert raw is not None and KEY_A.encode() not in raw and b'"owner"' in raw  # a digest, never the key

    # b's own conversation is b's alone the same way
    own = b.responses.create(input="Hello", **GREEDY)
    assert b.responses.retrieve(own.id).id == own.id
    _not_found(a.responses.retrieve, own.id)
    b.responses.delete(own.id)
    _not_found(b.responses.retrieve, own.id)


def test_a_turn_still_queued_is_still_queued_to_its_key_only(
    fleet: OpsFleet, clients: tuple[openai.OpenAI, openai.OpenAI]
) -> None:
    a, b = clients
    unknown = f"resp_{uuid.uuid4().hex}"
    with a.responses.create(model=IDLE, input="wait", stream=True, max_output_tokens=4, temperature=0) as stream:
        created = next(event for event in stream if event.type == "response.created")
        response_id = created.response.id  # queued: no worker serves idle-lm, and the stream waits for one

        refused = _not_found(b.responses.create, previous_response_id=response_id, input="More", **GREEDY)
        assert _as_unknown(refused, response_id, unknown) == _not_found(
            b.responses.create, previous_response_id=unknown, input="More", **GREEDY
        ), refused
        with pytest.raises(openai.BadRequestError) as queued:
            a.responses.create(previous_response_id=response_id, input="More", **GREEDY)
        body: Any = queued.value.body
        assert body["param"] == "previous_response_id" and "still queued" in body["message"], body
        _not_found(a.responses.retrieve, response_id)  # in progress: not stored yet, to its owner too
    # a left: the turn is cancelled, never stored, and what marked it as a's in the meantime goes
    key = RESPONSE_KEY.format(id=response_id)
    wait_until(lambda: not fleet.redis.exists(key), 30, "the claim of the turn left unstored to go")
    refused = _not_found(a.responses.create, previous_response_id=response_id, input="More", **GREEDY)
    assert refused["param"] == "previous_response_id", refused


def test_a_turn_that_is_not_to_be_stored_is_never_claimed(
    fleet: OpsFleet, clients: tuple[openai.OpenAI, openai.OpenAI]
) -> None:
    a = clients[0]
    with a.responses.create(model=IDLE, input="wait", stream=True, store=False, max_output_tokens=4) as stream:
        response_id = next(event for event in stream if event.type == "response.created").response.id
        assert not fleet.redis.exists(RESPONSE_KEY.format(id=response_id))
        refused = _not_found(a.responses.create, previous_response_id=response_id, input="More", **GREEDY)
        assert refused["param"] == "previous_response_id", refused  # it will never be stored: unknown, not queued
