"""The official ``openai`` SDK's ``client.responses`` against two real gateway processes on one Redis: a
stored conversation continued with ``previous_response_id`` through the other gateway (the stored
history rendered with the model's chat template; usage.input_tokens counts it), retrieve, input items,
delete, ``store=False``, streaming with the Responses event types, and errors in OpenAI's shape."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.integration.openai_fixtures import API_KEY, ops_models, ops_redis
from tests.integration.ops_fixtures import OpsFleet, wait_until
from tools.redis_server import EmbeddedRedis

__all__ = ["ops_models", "ops_redis"]

GREEDY: dict[str, Any] = {"model": "demo-lm", "max_output_tokens": 6, "temperature": 0}


def rendered(messages: list[tuple[str, str]]) -> str:
    """The demo LM's chat template (tools.generation_assets) over ``(role, text)`` turns."""
    return "".join(f"<|{role}|>\n{text}<|end|>\n" for role, text in messages) + "<|assistant|>\n"


def said_by(items: Any) -> list[tuple[str, str]]:
    """``(role, text)`` of input items (messages with one text part each)."""
    return [(item.role, item.content[0].text) for item in items]


TTL_S = 3600


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, ops_models: Any, ops_redis: EmbeddedRedis) -> Iterator[OpsFleet]:
    """Two gateway processes and one demo-lm worker on one Redis; stored responses live ``TTL_S``."""
    fleet = OpsFleet(tmp_path_factory.mktemp("responses"), ops_models, ops_redis)
    try:
        config = fleet.config(serve=("demo-lm",), models={"demo-lm": {"limits": {"max_input_tokens": 384}}},
                              api={"responses_ttl_s": TTL_S})  # fmt: skip
        fleet.worker(config, "demo-lm")
        fleet.gateway_replicas(config, 2)
        yield fleet
    finally:
        fleet.close()


@pytest.fixture(scope="module")
def clients(fleet: OpsFleet) -> tuple[openai.OpenAI, openai.OpenAI]:
    """One SDK client per gateway process."""
    a, b = (openai.OpenAI(base_url=gw.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60) for gw in fleet.gateways)
    return a, b


def test_conversation_continues_through_another_gateway(
    fleet: OpsFleet, clients: tuple[openai.OpenAI, openai.OpenAI]
) -> None:
    a, b = clients
    first = a.responses.create(input="Hi", instructions="Be brief.", store=True, **GREEDY)
    assert 0 < fleet.redis.ttl(f"fleet:response:{first.id}") <= TTL_S  # stored, and it expires
    assert first.id.startswith("resp_") and first.object == "response" and first.status in ("completed", "incomplete")
    assert first.usage is not None
    assert first.usage.input_tokens == len(rendered([("system", "Be brief."), ("user", "Hi")]).encode())
    said = first.output_text
    assert said and first.output[0].type == "message"  # the demo LM's greedy answer: a history worth applying

    # gateway b reads what gateway a stored, and renders instructions + history + the new input
    second = b.responses.create(previous_response_id=first.id, input="More", instructions="Be brief.", **GREEDY)
    turns = [("system", "Be brief."), ("user", "Hi"), ("assistant", said), ("user", "More")]
    assert second.usage is not None and second.usage.input_tokens == len(rendered(turns).encode())
    assert second.previous_response_id == first.id
    # the same conversation sent whole to chat completions gives the same greedy answer
    chat = a.chat.completions.create(
        model="demo-lm", messages=[{"role": r, "content": t} for r, t in turns], max_tokens=6, temperature=0  # type: ignore[misc]
    )
    assert chat.choices[0].message.content == second.output_text

    assert b.responses.retrieve(first.id).output_text == said
    items = b.responses.input_items.list(second.id, order="asc")
    assert said_by(items.data) == [("user", "Hi"), ("assistant", said), ("user", "More")]
    newest = a.responses.input_items.list(second.id, limit=1)
    assert said_by(newest.data) == [("user", "More")] and newest.has_more

    a.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as info:
        b.responses.create(previous_response_id=first.id, input="Again", **GREEDY)
    assert info.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert b.responses.retrieve(second.id).output_text == second.output_text  # the later turn stands alone


def test_message_list_input_store_false_and_expiry(
    fleet: OpsFleet, clients: tuple[openai.OpenAI, openai.OpenAI]
) -> None:
    a, b = clients
    messages: Any = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "H"}, {"type": "input_text", "text": "i"}]},
    ]
    unstored = a.responses.create(input=messages, store=False, **GREEDY)
    assert unstored.store is False and unstored.usage is not None
    assert unstored.usage.input_tokens == len(rendered([("developer", "Be brief."), ("user", "Hi")]).encode())
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as info:
        b.responses.create(previous_response_id=unstored.id, input="More", **GREEDY)
    body: Any = info.value.body
    assert body["param"] == "previous_response_id" and body["code"] == "not_found"
    stored = a.responses.create(input="Hi", **GREEDY)
    key = f"fleet:response:{stored.id}"
    fleet.redis.pexpire(key, 1)  # its TTL runs out now, as api.responses_ttl_s would
    wait_until(lambda: not fleet.redis.exists(key), 10, "the stored response to expire")
    with pytest.raises(openai.NotFoundError) as expired:
        b.responses.create(previous_response_id=stored.id, input="More", **GREEDY)
    assert expired.value.body["param"] == "previous_response_id"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as refused:
        a.responses.create(input="Hi", tools=[{"type": "web_search"}], **GREEDY)
    assert refused.value.body["param"] == "tools"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as long:  # the limit is the whole rendered history's
        a.responses.create(input="x" * 384, **GREEDY)
    assert long.value.body["param"] == "input"  # type: ignore[index]


def test_streamed_turn_continues_and_is_stored(clients: tuple[openai.OpenAI, openai.OpenAI]) -> None:
    a, b = clients
    first = a.responses.create(input="Hi", **GREEDY)
    stream = b.responses.create(previous_response_id=first.id, input="Go on", stream=True, **GREEDY)
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done: Any = events[-1]
    streamed = done.response
    assert streamed.output_text == deltas and streamed.usage is not None
    turns = [("user", "Hi"), ("assistant", first.output_text), ("user", "Go on")]
    assert streamed.usage.input_tokens == len(rendered(turns).encode())
    # the same turn unstreamed gives the same greedy text; the streamed one was stored for any gateway
    plain = a.responses.create(previous_response_id=first.id, input="Go on", store=False, **GREEDY)
    assert plain.output_text == deltas and deltas
    assert a.responses.retrieve(streamed.id).output_text == deltas
    # the SDK's own stream helper accumulates the events into its snapshot (indexing output and content
    # by each event's output_index/content_index) without complaint; its get_final_response wants
    # response.completed, which a turn cut by max_output_tokens replaces with response.incomplete, as at OpenAI
    with a.responses.stream(previous_response_id=first.id, input="Go on", store=False, **GREEDY) as helper:
        seen: list[Any] = list(helper)
    assert "".join(e.delta for e in seen if e.type == "response.output_text.delta") == deltas
    assert seen[-1].type == kinds[-1]


def test_metadata_and_user_past_openai_s_bounds_are_refused_before_anything_is_stored(
    clients: tuple[openai.OpenAI, openai.OpenAI],
) -> None:
    """Before: ``metadata`` of any size and a ``user`` of 900,000 characters were stored for 30 days (200)."""
    a, _ = clients
    tags = {f"k{i}": str(i) for i in range(16)}  # OpenAI's 16 pairs, and a user of the fleet's 256 characters
    kept = a.responses.create(input="Hi", metadata=tags, user="u" * 256, **GREEDY)
    assert a.responses.retrieve(kept.id).metadata == tags
    for fields, param in [
        ({"metadata": {**tags, "k16": "16"}}, "metadata"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
        ({"metadata": {"team": "v" * 513}}, "metadata.team"),
        ({"user": "u" * 257}, "user"),
    ]:
        with pytest.raises(openai.BadRequestError) as refused:
            a.responses.create(input="Hi", **fields, **GREEDY)  # type: ignore[arg-type]
        body: Any = refused.value.body
        assert (body["param"], body["type"]) == (param, "invalid_request_error"), body
        assert "at most" in body["message"], body
