"""Edges an application meets when it points existing OpenAI SDK code at the gateway: a message the SDK gave
back sent again, the model named as ``/v1/models`` names it, a body that is not UTF-8, and refusals that
say why (the official ``openai`` SDK, sync and async, against a real gateway, workers and Redis)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest

from tests.integration.openai_fixtures import API_KEY, Served, ops_models, ops_redis, served

__all__ = ["ops_models", "ops_redis", "served"]

HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base_url, api_key=API_KEY, max_retries=0, timeout=60)


def test_a_message_the_sdk_returned_can_be_sent_back(client: openai.OpenAI) -> None:
    """``message.model_dump()`` names every field of OpenAI's message, null (``refusal``, ``tool_calls``, …):
    before, each was a 400 "Extra inputs are not permitted" naming ``messages[1].refusal``."""
    first = client.chat.completions.create(model="demo-lm", messages=HI, max_tokens=1)  # type: ignore[arg-type]
    echoed = first.choices[0].message.model_dump()
    assert echoed["refusal"] is None and echoed["tool_calls"] is None
    again = client.chat.completions.create(model="demo-lm", messages=[*HI, echoed], max_tokens=1)  # type: ignore[list-item]
    assert again.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.BadRequestError) as info:  # a tool call in it cannot be rendered: said so, by name
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        client.chat.completions.create(model="demo-lm", messages=[*HI, {**echoed, "tool_calls": [call]}], max_tokens=1)  # type: ignore[list-item]
    body: dict[str, Any] = info.value.body  # type: ignore[assignment]
    assert body["param"] == "messages[1].tool_calls" and "no tool calling" in body["message"]


def test_answers_name_the_model_as_the_model_list_does(served: Served, client: openai.OpenAI) -> None:
    """A model is found whatever its case and ``-``/``_`` spelling; the answer named it as the caller spelled
    it (``DEMO_LM``), so two spellings of one model looked like two models."""
    listed = {m.id for m in client.models.list()}
    done = client.completions.create(model="DEMO_LM", prompt="Hi", max_tokens=2)
    chat = client.chat.completions.create(model="Demo_Lm", messages=HI, max_tokens=2)  # type: ignore[arg-type]
    chunks = list(client.completions.create(model="DEMO-LM", prompt="Hi", max_tokens=2, stream=True))
    vectors = client.embeddings.create(model="DEMO_ENCODER", input="Hi")
    response = client.responses.create(model="demo_lm", input="Hi", max_output_tokens=2)
    assert done.model == chat.model == response.model == "demo-lm" and vectors.model == "demo-encoder"
    assert {c.model for c in chunks} == {"demo-lm"} and {"demo-lm", "demo-encoder"} <= listed

    async def streamed() -> set[str]:
        aclient = openai.AsyncOpenAI(base_url=served.base_url, api_key=API_KEY, max_retries=0, timeout=60)
        async with aclient:
            stream = await aclient.chat.completions.create(model="DEMO_LM", messages=HI, max_tokens=2, stream=True)  # type: ignore[arg-type]
            return {chunk.model async for chunk in stream}

    assert asyncio.run(streamed()) == {"demo-lm"}


@pytest.mark.parametrize(
    ("path", "status", "shape"),
    [("/v1/chat/completions", 400, "openai"), ("/v1/completions", 400, "openai"), ("/v1/requests", 422, "native")],
)
def test_a_body_that_is_not_utf8_is_refused_naming_the_body(served: Served, path: str, status: int, shape: str) -> None:
    """Before: ``{"message": "There was an error parsing the body", "param": null, "code": "http"}``."""
    raw = b'{"model": "demo-lm", "prompt": "\xff", "messages": [], "text": "\xff"}'
    resp = served.http.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert resp.status_code == status, resp.text
    doc = resp.json()
    error = doc["error"] if shape == "openai" else {"param": doc["field"], "code": doc["error"], **doc}
    assert error["param"] == "body" and error["code"] == "invalid_request", doc
    assert f"not UTF-8: byte 0xFF at byte {raw.index(0xFF)}" in error["message"]


@pytest.mark.parametrize(
    ("extra", "param", "why"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools", "tool"),
        ({"tool_choice": "required"}, "tool_choice", "tool"),
        ({"response_format": {"type": "json_object"}}, "response_format", "JSON"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text", "required"),
    ],
)
def test_chat_refusals_say_why(client: openai.OpenAI, extra: dict[str, Any], param: str, why: str) -> None:
    """Before, tools and response_format were refused "without log-probabilities", and a text part without text
    as a part whose type is not text."""
    args: dict[str, Any] = {"model": "demo-lm", "messages": HI, "max_tokens": 1, **extra}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**args)
    body: dict[str, Any] = info.value.body  # type: ignore[assignment]
    assert body["param"] == param and why in body["message"] and "log-probabilities" not in body["message"], body


def test_responses_refusals_say_why(served: Served) -> None:
    resp = httpx.post(served.base_url + "/responses", headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"model": "demo-lm", "input": "Hi", "background": True})  # fmt: skip
    error = resp.json()["error"]
    assert resp.status_code == 400 and error["param"] == "background" and "tools or reasoning" not in error["message"]


def test_the_rest_of_openai_s_chat_fields_are_answered_not_refused_as_unknown(client: openai.OpenAI) -> None:
    """SDK code that sets ``store=False``, ``metadata``, ``service_tier``, ``prompt_cache_key`` or
    ``safety_identifier`` gets its answer (they change nothing the fleet does); one that asks for reasoning,
    audio or web search gets a 400 naming the field and why. Before, each was a 400 "Extra inputs are not
    permitted", as for a field OpenAI does not define."""
    done = client.chat.completions.create(
        model="demo-lm", messages=HI, max_tokens=2, store=False, metadata={"team": "search"},  # type: ignore[arg-type]
        service_tier="auto", prompt_cache_key="conversation-7", safety_identifier="user-hash", modalities=["text"],
    )
    assert done.choices[0].finish_reason in ("length", "stop")
    for extra, param, why in [({"reasoning_effort": "low"}, "reasoning_effort", "do not reason"),
                              ({"web_search_options": {}}, "web_search_options", "no web search"),
                              ({"store": True}, "store", "/v1/responses stores")]:  # fmt: skip
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="demo-lm", messages=HI, max_tokens=2, **extra)  # type: ignore[arg-type]
        body: dict[str, Any] = info.value.body  # type: ignore[assignment]
        assert body["param"] == param and why in body["message"], body


def test_the_rest_of_openai_s_responses_fields_are_answered_not_refused_as_unknown(client: openai.OpenAI) -> None:
    """The same for ``/v1/responses``: ``service_tier``, ``prompt_cache_key``, ``safety_identifier`` and
    ``max_tool_calls`` are answered, ``conversation`` and ``top_logprobs`` refused naming the field and why."""
    done = client.responses.create(model="demo-lm", input="Hi", max_output_tokens=2, service_tier="auto",
                                   prompt_cache_key="conversation-7", safety_identifier="user-hash", max_tool_calls=1)
    assert done.status in ("completed", "incomplete") and done.model == "demo-lm"
    for extra, param, why in [({"conversation": "conv_1"}, "conversation", "previous_response_id"),
                              ({"top_logprobs": 2}, "top_logprobs", "log-probabilities")]:  # fmt: skip
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model="demo-lm", input="Hi", max_output_tokens=2, **extra)  # type: ignore[arg-type]
        body: dict[str, Any] = info.value.body  # type: ignore[assignment]
        assert body["param"] == param and why in body["message"], body


def test_top_p_zero_is_the_most_likely_token_alone(client: openai.OpenAI) -> None:
    """OpenAI takes ``top_p`` from 0 to 1; 0 keeps the most likely token alone, so its answer is the greedy
    one whatever the temperature. Before: 400 "top_p: Input should be greater than 0"."""
    seeded = {"model": "demo-lm", "max_tokens": 12, "seed": 5, "extra_body": {"ignore_eos": True}}
    greedy = client.completions.create(prompt="Once", temperature=0, **seeded)  # type: ignore[call-overload]
    nucleus = client.completions.create(prompt="Once", temperature=1.5, top_p=0, **seeded)  # type: ignore[call-overload]
    hot = client.completions.create(prompt="Once", temperature=1.5, top_p=1, **seeded)  # type: ignore[call-overload]
    assert nucleus.choices[0].text == greedy.choices[0].text != hot.choices[0].text
    chat = client.chat.completions.create(model="demo-lm", messages=HI, max_tokens=3, top_p=0)  # type: ignore[arg-type]
    response = client.responses.create(model="demo-lm", input="Hi", max_output_tokens=3, top_p=0)
    assert chat.choices[0].finish_reason in ("length", "stop") and response.status in ("completed", "incomplete")


def test_message_content_that_is_an_empty_list_is_refused_naming_it(client: openai.OpenAI) -> None:
    """OpenAI refuses ``content: []`` for every role; before, the gateway rendered it as an empty turn."""
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="demo-lm", messages=[*HI, {"role": "user", "content": []}], max_tokens=1)  # type: ignore[list-item]
    body: dict[str, Any] = info.value.body  # type: ignore[assignment]
    assert body["param"] == "messages[1].content" and "empty array" in body["message"]
