"""The OpenAI face against what users send it with the official ``openai`` SDK: parameters at and past their
bounds, messages OpenAI refuses, the wrong kind of model, streams' usage chunks and endings. One served fleet
(real gateway, demo-lm and demo-encoder workers, Redis) for the module; every answer is a result or an
OpenAI-shaped error (``type``, ``param``, ``code``) that the SDK raises as the matching class.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.integration.openai_fixtures import API_KEY, Served, ops_models, ops_redis, served

__all__ = ["ops_models", "ops_redis", "served"]

HI = [{"role": "user", "content": "Hi"}]
CHAT = {"model": "demo-lm", "messages": HI, "max_tokens": 2}
COMPLETION = {"model": "demo-lm", "prompt": "Hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base_url, api_key=API_KEY, max_retries=0, timeout=60)


def _refusal(call: Any, kind: type[openai.APIStatusError] = openai.BadRequestError) -> dict[str, Any]:
    """The OpenAI error body of ``call()``, which must raise ``kind``."""
    with pytest.raises(kind) as info:
        call()
    body: dict[str, Any] = info.value.body  # type: ignore[assignment]
    assert body["type"] == "invalid_request_error" and body["code"], body
    return body


def test_a_model_that_does_not_generate_is_refused_by_name_on_every_generating_face(client: openai.OpenAI) -> None:
    """An encoder named on chat or /v1/responses: before, 400 with param ``messages`` (``input``) saying the
    model has no chat template and to "use /v1/completions with a prompt", which refuses it too. Now every
    generating face names ``model`` and points at /v1/embeddings, as /v1/completions already did."""
    calls = {
        "completions": lambda: client.completions.create(model="demo-encoder", prompt="Hi", max_tokens=2),
        "chat": lambda: client.chat.completions.create(model="demo-encoder", messages=HI, max_tokens=2),  # type: ignore[arg-type]
        "chat stream": lambda: client.chat.completions.create(model="demo-encoder", messages=HI, stream=True),  # type: ignore[arg-type]
        "responses": lambda: client.responses.create(model="demo-encoder", input="Hi", max_output_tokens=2),
    }
    for face, call in calls.items():
        body = _refusal(call)
        assert body["param"] == "model", (face, body)
        assert body["message"].startswith("model 'demo-encoder' cannot generate text: an encoder model"), (face, body)
        assert "POST /v1/embeddings" in body["message"] and "chat template" not in body["message"], (face, body)
    # an LM without a chat template is still told about the template, naming the messages
    body = _refusal(lambda: client.chat.completions.create(model="plain-lm", messages=HI, max_tokens=2))  # type: ignore[arg-type]
    assert body["param"] == "messages" and "no chat template" in body["message"]


def test_a_tool_message_needs_the_id_of_the_call_it_answers(client: openai.OpenAI) -> None:
    """OpenAI requires ``tool_call_id`` on a ``tool`` message; before, one without it was rendered as a turn."""
    untied: list[Any] = [*HI, {"role": "tool", "content": "42"}]
    body = _refusal(lambda: client.chat.completions.create(model="demo-lm", messages=untied, max_tokens=2))
    assert body["param"] == "messages[1].tool_call_id" and "required for a 'tool' message" in body["message"]
    tied: list[Any] = [*HI, {"role": "tool", "content": "42", "tool_call_id": "call_1"}]
    answered = client.chat.completions.create(model="demo-lm", messages=tied, max_tokens=2)
    assert answered.choices[0].finish_reason in ("stop", "length")


BOUNDS: list[tuple[str, dict[str, Any], str | None]] = [
    # (face, fields over the base body, param of the 400 or None for an answer); already right before
    ("chat", {"temperature": 0}, None), ("chat", {"temperature": 2}, None),
    ("chat", {"temperature": 2.01}, "temperature"), ("chat", {"temperature": -0.1}, "temperature"),
    ("chat", {"temperature": "1"}, "temperature"), ("chat", {"top_p": 1.01}, "top_p"),
    ("chat", {"n": 1}, None), ("chat", {"n": 2}, "n"), ("chat", {"n": 2, "stream": True}, "n"),
    ("chat", {"max_tokens": 0}, "max_tokens"), ("chat", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat", {"max_tokens": 10**9}, "max_tokens"), ("chat", {"max_tokens": "2"}, "max_tokens"),
    ("chat", {"stop": ["a", "b", "c", "d"]}, None), ("chat", {"stop": ""}, "stop"), ("chat", {"stop": 5}, "stop"),
    ("chat", {"logprobs": True}, "logprobs"), ("chat", {"logprobs": False}, None),
    ("chat", {"top_logprobs": 20}, "top_logprobs"), ("chat", {"top_logprobs": 21}, "top_logprobs"),
    ("chat", {"logit_bias": {}}, None), ("chat", {"logit_bias": {"50": 100}}, "logit_bias"),
    ("chat", {"logit_bias": {"50": "x"}}, "logit_bias.50"), ("chat", {"seed": -1}, None),
    ("chat", {"seed": 2**64}, "seed"), ("chat", {"presence_penalty": 0}, None),
    ("chat", {"frequency_penalty": 0.5}, "frequency_penalty"), ("chat", {"user": 5}, "user"),
    ("chat", {"response_format": {"type": "text"}}, None), ("chat", {"response_format": {"type": "json_object"}},
                                                                    "response_format"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("chat", {"tool_choice": "auto"}, "tool_choice"), ("chat", {"tool_choice": "none"}, None),
    ("chat", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("chat", {"messages": []}, "messages"), ("chat", {"messages": [{"role": "wizard", "content": "x"}]},
                                            "messages[0].role"),
    ("chat", {"messages": [{"role": "system", "content": "Be brief."}]}, None),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type"),
    ("chat", {"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ("chat", {"messages": [{"role": "user", "content": "Hi", "name": "bob"}]}, None),
    ("completion", {"best_of": 2}, "best_of"), ("completion", {"logprobs": 5}, "logprobs"),
    ("completion", {"echo": True}, "echo"), ("completion", {"prompt": ""}, "prompt"),
    ("completion", {"prompt": ["a", "b"]}, "prompt"), ("completion", {"prompt": [10**6]}, "prompt[0]"),
]


@pytest.mark.parametrize(("face", "fields", "param"), BOUNDS)
def test_parameters_at_and_past_their_bounds(
    client: openai.OpenAI, face: str, fields: dict[str, Any], param: str | None
) -> None:
    body = {**(CHAT if face == "chat" else COMPLETION), **fields}
    path = "/chat/completions" if face == "chat" else "/completions"
    if param is None:
        answer: Any = client.post(path, cast_to=object, body=body)
        assert answer["choices"][0]["finish_reason"] in ("stop", "length"), answer
        return
    error = _refusal(lambda: client.post(path, cast_to=object, body=body))
    assert error["param"] == param, error


@pytest.mark.parametrize(
    ("face", "fields", "param"),
    [("chat", {"messages": [{"role": "user", "content": "word " * 400}]}, "messages"),
     ("completion", {"prompt": [5] * 65}, "prompt"), ("completion", {"prompt": "word " * 400}, "prompt")],
)
def test_past_the_model_s_context_is_a_400_naming_the_limit(
    client: openai.OpenAI, face: str, fields: dict[str, Any], param: str
) -> None:
    """OpenAI's ``context_length_exceeded`` here, the code clients test for to trim and retry (the fleet's
    ``input_too_long`` before), the field, and the limit in the message."""
    body = {**(CHAT if face == "chat" else COMPLETION), **fields}
    path = "/chat/completions" if face == "chat" else "/completions"
    error = _refusal(lambda: client.post(path, cast_to=object, body=body))
    assert error["param"] == param and error["code"] == "context_length_exceeded", error
    assert "the limit is max_input_tokens=64" in error["message"], error


def test_a_chat_stream_s_usage_chunk_comes_last_then_done(served: Served, client: openai.OpenAI) -> None:
    """With ``include_usage``: every chunk before the last has ``usage`` null, one chunk carries the
    finish reason, the last one has no choices and the usage, and the stream ends with ``[DONE]``."""
    args: dict[str, Any] = {**CHAT, "max_tokens": 5, "extra_body": {"ignore_eos": True}}
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert [c.usage is None for c in chunks] == [True] * (len(chunks) - 1) + [False]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 5
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 2) + ["length"]
    raw = httpx.post(served.base_url + "/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                     json={**CHAT, "stream": True}, timeout=60)  # fmt: skip
    assert raw.text.rstrip().endswith("data: [DONE]") and raw.text.count("data: [DONE]") == 1


def test_embeddings_inputs_and_base64(client: openai.OpenAI) -> None:
    """Every input form gives one vector each; base64 decodes to the float answer. Already right before."""
    floats = client.embeddings.create(model="demo-encoder", input=["Hi", "there"], encoding_format="float")
    decoded = client.embeddings.create(model="demo-encoder", input=["Hi", "there"])  # the SDK asks for base64
    assert [d.embedding for d in decoded.data] == [d.embedding for d in floats.data]
    assert len(client.embeddings.create(model="demo-encoder", input=[[1, 2], [3]]).data) == 2
    assert len(client.embeddings.create(model="demo-encoder", input=[1, 2, 3]).data) == 1
    for given, param in [("", "input"), ([], "input"), ([""], "input[0]"), ([[]], "input[0]")]:
        error = _refusal(lambda given=given: client.embeddings.create(model="demo-encoder", input=given))
        assert error["param"] == param, (given, error)
