"""The OpenAI face's translation, pure: request fields → GenerationParams, refusals naming the field,
prompts, chat rendering, results and stream events → OpenAI's shapes, error statuses."""

from __future__ import annotations

import base64
import struct
from typing import Any

import pytest
from pydantic import ValidationError

from gateway.chat import ChatTemplate, render_chat
from gateway.errors import is_openai_path, openai_error, openai_error_of, status_of
from gateway.openai_mapping import (
    ChunkWriter,
    chat_messages,
    check_supported,
    completion_prompt,
    embedding_inputs,
    embedding_list,
    finish_reason,
    generation_fallbacks,
    generation_params,
    input_field,
    prompt_field,
    rename_field,
    stream_error,
)
from gateway.openai_schema import ChatBody, CompletionBody, EmbeddingBody
from protocol.errors import (
    IdempotencyConflict,
    InputTooLong,
    InvalidRequest,
    QueueFull,
    RequestCancelled,
    RequestExpired,
    RequestNotFound,
    ResultTimeout,
    UnknownModel,
)
from protocol.messages import Usage
from protocol.streams import StreamEvent
from tools.generation_assets import CHAT_TEMPLATE

HI = [{"role": "user", "content": "Hi"}]


def completion(**fields: Any) -> CompletionBody:
    return CompletionBody.model_validate({"model": "m", "prompt": "p", **fields})


def chat(**fields: Any) -> ChatBody:
    return ChatBody.model_validate({"model": "m", "messages": HI, **fields})


# -- refusals ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "field"),
    [
        (completion(n=2), "n"),
        (completion(best_of=3), "best_of"),
        (completion(frequency_penalty=0.1), "frequency_penalty"),
        (completion(presence_penalty=-1.0), "presence_penalty"),
        (completion(logit_bias={"5": 1.0}), "logit_bias"),
        (completion(echo=True), "echo"),
        (completion(logprobs=0), "logprobs"),
        (completion(suffix="!"), "suffix"),
        (chat(n=4), "n"),
        (chat(logprobs=True), "logprobs"),
        (chat(top_logprobs=2), "top_logprobs"),
        (chat(tools=[{"type": "function"}]), "tools"),
        (chat(tool_choice="auto"), "tool_choice"),
        (chat(response_format={"type": "json_object"}), "response_format"),
        (EmbeddingBody(model="e", input="x", dimensions=8), "dimensions"),
    ],
)
def test_unsupported_fields_are_refused_by_name(body: Any, field: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        check_supported(body)
    assert info.value.field == field and f"{field} = " in info.value.message


@pytest.mark.parametrize(
    "body",
    [
        completion(),
        completion(n=1, best_of=1, frequency_penalty=0, presence_penalty=0.0, logit_bias={}, echo=False, user="u"),
        chat(n=1, logprobs=False, tool_choice="none", tools=[], response_format={"type": "text"}),
        chat(stream=True, parallel_tool_calls=True, stream_options={"include_usage": True}),
        # the rest of OpenAI's chat fields, as SDK code sets them when it changes nothing the fleet does
        chat(store=False, metadata={"team": "search"}, service_tier="auto", prompt_cache_key="conv-1",
             safety_identifier="user-hash", modalities=["text"], functions=[], function_call="none"),
        EmbeddingBody(model="e", input=["a"], encoding_format="base64", user="u"),
    ],
)
def test_what_the_sdks_send_by_default_passes(body: Any) -> None:
    check_supported(body)


# -- sampling ------------------------------------------------------------------------------------
def test_openai_defaults_and_one_to_one_fields() -> None:
    # only what the caller sent is set: the rest is resolved with the model's generation_config.json
    assert generation_params(completion()).model_fields_set == {"stream"}
    assert generation_fallbacks("completion", 64) == {"temperature": 1.0, "max_new_tokens": 16}
    assert generation_fallbacks("chat", 64) == {"temperature": 1.0, "max_new_tokens": 64}
    params = generation_params(
        completion(max_tokens=7, temperature=0, top_p=0.5, seed=3, stop="\n", stream=True, top_k=4,
                   repetition_penalty=1.2, ignore_eos=True, stop_token_ids=[2]),
    )  # fmt: skip
    assert (params.max_new_tokens, params.temperature, params.top_p, params.seed) == (7, 0.0, 0.5, 3)
    assert params.stop == ["\n"] and params.stream is True and params.top_k == 4
    assert params.repetition_penalty == 1.2 and params.ignore_eos is True and params.stop_token_ids == [2]
    assert generation_params(completion(stop=["a", "b"])).stop == ["a", "b"]


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"max_tokens": 5}, 5),
        ({"max_completion_tokens": 9}, 9),
        ({"max_tokens": 5, "max_completion_tokens": 9}, 9),
    ],
)
def test_chat_length_prefers_max_completion_tokens(fields: dict[str, Any], expected: int | None) -> None:
    params = generation_params(chat(**fields))
    assert (params.max_new_tokens if "max_new_tokens" in params.model_fields_set else None) == expected


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (completion(repetition_penalty=0.0), "repetition_penalty"),
        (completion(stop=[str(i) for i in range(17)]), "stop"),
        (completion(stop=["x" * 300]), "stop"),
        (completion(top_k=2, stop_token_ids=list(range(65))), "stop_token_ids"),
    ],
)
def test_out_of_range_values_name_the_openai_field(body: CompletionBody, field: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        generation_params(body)
    assert info.value.field == field, info.value.message


@pytest.mark.parametrize(
    ("field", "names", "prefix", "renamed"),
    [
        ("output.generation.max_new_tokens", {"max_new_tokens": "max_tokens"}, "output.generation.", "max_tokens"),
        ("input_ids", {"input_ids": "prompt"}, "", "prompt"),
        ("input_ids[3]", {"input_ids": "input[1]"}, "", "input[1][3]"),
        ("output.kind", {"output.kind": "model"}, "output.generation.", "model"),
        ("request_id", {"input_ids": "prompt"}, "", "request_id"),
    ],
)
def test_rename_field(field: str, names: dict[str, str], prefix: str, renamed: str) -> None:
    exc = rename_field(InputTooLong(f"{field} has 70 tokens", field, 64), names, prefix)
    assert isinstance(exc, InputTooLong) and exc.field == renamed and exc.limit == 64
    assert exc.message == f"{renamed} has 70 tokens", "the message names the field as the caller did"
    not_invalid = RequestExpired("late", field, None)
    assert rename_field(not_invalid, names, prefix) is not_invalid


# -- prompts -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("Hi", (None, "Hi")), (["Hi"], (None, "Hi")), ([5, 6], ([5, 6], None)), ([[5, 6]], ([5, 6], None))],
)
def test_completion_prompt_forms(prompt: Any, expected: Any) -> None:
    assert completion_prompt(completion(prompt=prompt)) == expected


@pytest.mark.parametrize("prompt", [["a", "b"], [[1], [2]], []])
def test_one_prompt_per_completion(prompt: Any) -> None:
    with pytest.raises(InvalidRequest, match="one prompt per request") as info:
        completion_prompt(completion(prompt=prompt))
    assert info.value.field == "prompt"


def test_embedding_inputs() -> None:
    assert embedding_inputs(EmbeddingBody(model="e", input="a")) == [(None, "a")]
    assert embedding_inputs(EmbeddingBody(model="e", input=["a", "b"])) == [(None, "a"), (None, "b")]
    assert embedding_inputs(EmbeddingBody(model="e", input=[1, 2])) == [([1, 2], None)]
    assert embedding_inputs(EmbeddingBody(model="e", input=[[1], [2, 3]])) == [([1], None), ([2, 3], None)]
    with pytest.raises(InvalidRequest) as info:
        embedding_inputs(EmbeddingBody(model="e", input=[]))
    assert info.value.field == "input"


def test_fields_are_named_as_the_caller_nested_them() -> None:
    assert [prompt_field(completion(prompt=p)) for p in ("hi", [5, 6], ["hi"], [[5, 6]])] == [
        "prompt", "prompt", "prompt[0]", "prompt[0]"]  # fmt: skip
    bodies = [EmbeddingBody(model="e", input=x) for x in ("a", [5, 6], ["a", "b"], [[5], [6]])]
    assert [input_field(b, 1) for b in bodies] == ["input", "input", "input[1]", "input[1]"]


@pytest.mark.parametrize(
    ("given", "field"),
    [("", "input"), ([], "input"), ([""], "input[0]"), (["a", ""], "input[1]"), ([[1], []], "input[1]"),
     ([[]], "input[0]")],
)  # fmt: skip
def test_empty_embedding_inputs_are_refused_naming_them(given: Any, field: str) -> None:
    with pytest.raises(InvalidRequest, match="empty") as info:
        embedding_inputs(EmbeddingBody(model="e", input=given))
    assert info.value.field == field


def test_chat_messages_join_text_parts_and_refuse_others() -> None:
    body = chat(messages=[
        {"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
        {"role": "user", "content": "Hi", "name": "ann"},
        {"role": "assistant", "content": None},
    ])  # fmt: skip
    assert chat_messages(body) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi", "name": "ann"},
        {"role": "assistant", "content": ""},
    ]
    image = chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}])
    with pytest.raises(InvalidRequest) as info:
        chat_messages(image)
    assert info.value.field == "messages[0].content[0].type"


@pytest.mark.parametrize(
    ("body", "field", "why"),
    [
        (completion(best_of=3), "best_of", "one generation per request"),
        (completion(echo=True), "echo", "not the prompt"),
        (completion(suffix="!"), "suffix", "fill-in-the-middle"),
        (completion(logprobs=1), "logprobs", "log-probabilities"),
        (chat(top_logprobs=2), "top_logprobs", "log-probabilities"),
        (chat(tools=[{"type": "function"}]), "tools", "no tool or function calling"),
        (chat(tool_choice="required"), "tool_choice", "no tool or function calling"),
        (chat(response_format={"type": "json_object"}), "response_format", "no constrained (JSON) decoding"),
        (chat(store=True), "store", "/v1/responses stores"),
        (chat(modalities=["text", "audio"]), "modalities", "text only"),
        (chat(reasoning_effort="low"), "reasoning_effort", "do not reason"),
        (chat(verbosity="low"), "verbosity", "max_tokens"),
        (chat(prediction={"type": "content", "content": "x"}), "prediction", "no predicted outputs"),
        (chat(audio={"voice": "alloy", "format": "wav"}), "audio", "text only"),
        (chat(web_search_options={}), "web_search_options", "no web search"),
        (chat(functions=[{"name": "f"}]), "functions", "no tool or function calling"),
        (chat(function_call="auto"), "function_call", "only 'none'"),
    ],
)
def test_each_refusal_says_why_that_field_cannot_be_honoured(body: Any, field: str, why: str) -> None:
    """Before, every one of these said "the fleet returns plain text without log-probabilities"."""
    with pytest.raises(InvalidRequest) as info:
        check_supported(body)
    assert info.value.field == field and why in info.value.message


def test_a_message_the_sdk_gives_back_can_be_sent_again() -> None:
    """``ChatCompletionMessage.model_dump()`` names every field OpenAI defines, null: before, each was an
    unknown field (400 "Extra inputs are not permitted")."""
    echoed = {"role": "assistant", "content": "Hello", "refusal": None, "annotations": None, "audio": None,
              "function_call": None, "tool_calls": None}  # fmt: skip
    tool = {"role": "tool", "content": "42", "tool_call_id": "call_1"}
    assert chat_messages(chat(messages=[*HI, echoed, tool])) == [
        *HI, {"role": "assistant", "content": "Hello"}, {"role": "tool", "content": "42", "tool_call_id": "call_1"}
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tool_calls", [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]),
        ("function_call", {"name": "f", "arguments": "{}"}),
        ("audio", {"id": "a1"}),
        ("refusal", "I can't"),
    ],
)
def test_a_message_holding_what_the_fleet_cannot_render_is_refused_by_name(field: str, value: Any) -> None:
    message = {"role": "assistant", "content": None, field: value}
    with pytest.raises(InvalidRequest) as info:
        chat_messages(chat(messages=[*HI, message]))
    assert info.value.field == f"messages[1].{field}" and "not supported" in info.value.message


def test_a_text_part_without_text_is_named_by_its_text() -> None:
    """Before: ``messages[0].content[0].type = 'text': only text parts are supported``."""
    with pytest.raises(InvalidRequest) as info:
        chat_messages(chat(messages=[{"role": "user", "content": [{"type": "text"}]}]))
    assert info.value.field == "messages[0].content[0].text" and "required" in info.value.message


def test_chat_template_renders_as_transformers_does() -> None:
    template = ChatTemplate(CHAT_TEMPLATE)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert render_chat(template, messages) == "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n"
    hf_style = ChatTemplate(
        "{{ bos_token }}{% for m in messages %}\n  {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}",
        bos_token="<s>",
    )
    assert render_chat(hf_style, HI) == "<s>  user: Hi\nassistant:"  # trim_blocks / lstrip_blocks on
    strict = ChatTemplate("{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}")
    with pytest.raises(InvalidRequest, match="system first") as info:
        render_chat(strict, HI)
    assert info.value.field == "messages"
    with pytest.raises(InvalidRequest):
        render_chat(ChatTemplate("{{ messages[0].__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}"), HI)


# -- results and streams -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fleet", "openai"), [("stop", "stop"), ("length", "length"), ("deadline", "length"), ("cancelled", "stop")]
)
def test_finish_reasons(fleet: Any, openai: str) -> None:
    assert finish_reason(fleet) == openai


USAGE = Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5)


def test_chat_chunks_open_with_the_role_and_end_with_finish_and_usage() -> None:
    writer = ChunkWriter("chat", "r1", "demo-lm", 100, include_usage=True)
    (opening,) = writer.opening()
    assert opening["id"] == "chatcmpl-r1" and opening["object"] == "chat.completion.chunk"
    assert opening["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    (tok,) = writer.on_event(StreamEvent(type="token", index=0, token_id=9, text="He"))
    assert tok["choices"][0] == {"index": 0, "delta": {"content": "He"}, "logprobs": None, "finish_reason": None}
    assert writer.on_event(StreamEvent(type="token", index=1, token_id=200, text="")) == []  # half a character
    final, usage = writer.on_event(StreamEvent(type="final", index=2, text="é", finish_reason="length", usage=USAGE))
    assert final["choices"][0]["delta"] == {"content": "é"} and final["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                                                     "prompt_tokens_details": {"cached_tokens": 0}}


def test_continuous_usage_counts_every_chunk_and_ends_with_the_workers() -> None:
    """vLLM's ``continuous_usage_stats``: usage so far on every chunk (a token without text adds none but
    counts), the worker's own usage on the final one, then OpenAI's usage-only chunk."""
    writer = ChunkWriter("chat", "r3", "demo-lm", 100, include_usage=True, continuous_usage=True, prompt_tokens=3)
    so_far = [c["usage"] for c in writer.opening()]
    for i, text in enumerate(["a", "", "b"]):
        so_far += [c["usage"] for c in writer.on_event(StreamEvent(type="token", index=i, token_id=9, text=text))]
    worker = Usage(prompt_tokens=3, completion_tokens=4, total_tokens=7, cached_tokens=2)
    final, usage = writer.on_event(StreamEvent(type="final", index=4, finish_reason="length", usage=worker))
    assert [u["completion_tokens"] for u in so_far] == [0, 1, 3]
    assert all(u["prompt_tokens"] == 3 and u["total_tokens"] == 3 + u["completion_tokens"] for u in so_far)
    assert final["usage"] == usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                                                "prompt_tokens_details": {"cached_tokens": 2}}
    assert usage["choices"] == []


def test_completion_chunks() -> None:
    writer = ChunkWriter("completion", "r2", "demo-lm", 100)
    assert writer.opening() == []
    (tok,) = writer.on_event(StreamEvent(type="token", index=0, token_id=9, text="a"))
    assert tok["object"] == "text_completion" and tok["id"] == "cmpl-r2"
    assert tok["choices"] == [{"index": 0, "text": "a", "logprobs": None, "finish_reason": None}]
    (final,) = writer.on_event(StreamEvent(type="final", index=1, finish_reason="stop", usage=USAGE))
    assert final["choices"][0]["text"] == "" and final["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("error", "status_type", "code"),
    [
        ("InputTooLong", "invalid_request_error", "context_length_exceeded"),
        ("RequestExpired", "timeout_error", "expired"),
        ("RequestCancelled", "invalid_request_error", "cancelled"),
        ("SomethingNew", "server_error", "fleet_error"),
    ],
)
def test_error_events_become_openai_errors(error: str, status_type: str, code: str) -> None:
    event = StreamEvent(type="error", index=0, error=error, message="why", field="input_ids", limit=64)
    (payload,) = ChunkWriter("chat", "r", "m", 1).on_event(event)
    assert payload == {"error": {"message": "why", "type": status_type, "param": "input_ids", "code": code}}


def test_base64_embeddings_are_little_endian_float32() -> None:
    from protocol.messages import InferenceResult

    result = InferenceResult.model_validate({
        "request_id": "r", "model": "e", "version": "1", "kind": "embedding", "input_tokens": 2,
        "embedding": [0.5, -1.0, 0.25],
        "timings": {"queue_wait_ms": 0, "batch_wait_ms": 0, "inference_ms": 0, "batch_size": 1,
                    "padded_tokens": 2, "worker": "w"},
    })  # fmt: skip
    packed = embedding_list("e", [result, result], "base64")
    raw = base64.b64decode(str(packed.data[1].embedding))
    assert struct.unpack("<3f", raw) == (0.5, -1.0, 0.25) and packed.data[1].index == 1
    assert packed.usage.prompt_tokens == packed.usage.total_tokens == 4
    assert embedding_list("e", [result], "float").data[0].embedding == [0.5, -1.0, 0.25]


# -- error statuses and shapes -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("exc", "native", "openai"),
    [
        (InputTooLong("m", "input_ids", 1), 422, 400),
        (UnknownModel("m", "model", None), 422, 404),
        (QueueFull("m", "model", 1, 2.0), 429, 429),
        (RequestNotFound("m", "request_id", None), 404, 404),
        (RequestCancelled("m", "request_id", None), 409, 409),
        (IdempotencyConflict("m", "request_id", None), 409, 409),
        (ResultTimeout("m", "timeout_s", 1), 504, 504),
        (RequestExpired("m", "deadline", None), 504, 504),
    ],
)
def test_status_of(exc: Any, native: int, openai: int) -> None:
    assert (status_of(exc, openai=False), status_of(exc, openai=True)) == (native, openai)


def test_openai_shapes_and_paths() -> None:
    payload = {"error": "queue_full", "type": "QueueFull", "message": "full", "field": "model", "limit": 4}
    assert openai_error(429, payload) == {
        "error": {"message": "full", "type": "rate_limit_error", "param": "model", "code": "queue_full"}
    }
    assert openai_error_of(InputTooLong("long", "prompt", 64))["error"]["type"] == "invalid_request_error"
    assert openai_error(401, {**payload, "error": "unauthorized"})["error"]["type"] == "authentication_error"
    assert [is_openai_path(p) for p in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings")] == [True] * 3
    assert is_openai_path("/v1/models") and is_openai_path("/v1/models/demo-lm")
    assert not any(is_openai_path(p) for p in ("/v1/requests", "/v1/requests/x/stream", "/v1/requests:batch",
                                               "/healthz", "/metrics", "/v2/files"))  # fmt: skip
    # a route of OpenAI's the fleet lacks answers in OpenAI's shape: the SDK reads it as its own
    assert all(is_openai_path(p) for p in ("/v1/files", "/v1/audio/speech", "/v1/fine_tuning/jobs"))


def test_an_openai_seed_is_any_int64_and_a_negative_one_is_taken_mod_2_63() -> None:
    assert generation_params(completion(seed=-1)).seed == 2**63 - 1
    assert generation_params(completion(seed=7)).seed == 7
    with pytest.raises(ValidationError):
        completion(seed=2**63)


def test_a_stream_error_event_is_openai_s_error_with_the_fleet_s_code() -> None:
    """The Responses stream's error event used the worker's class name as its code (``RequestExpired``); both
    faces now give the code the same error has everywhere else."""
    event = StreamEvent(type="error", index=0, error="RequestExpired", message="past its deadline",
                        field="deadline_unix_s", limit=None)  # fmt: skip
    err = stream_error(event)
    assert (err["code"], err["param"], err["message"]) == ("expired", "deadline_unix_s", "past its deadline")
    assert err["type"] == "timeout_error"


def test_a_response_format_without_its_type_is_refused_naming_the_type() -> None:
    """OpenAI requires ``response_format.type``; ``{}`` was taken as text."""
    with pytest.raises(InvalidRequest) as info:
        check_supported(chat(response_format={}))
    assert info.value.field == "response_format.type" and "required" in info.value.message
