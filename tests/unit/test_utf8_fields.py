"""Every caller string of every body (OpenAI, Responses, native) must encode as UTF-8: a lone surrogate
(JSON's ``"\\ud800"``) is refused where the body is parsed, naming the field as sent and the character
(protocol.utf8, gateway.invalid_fields). Pure: the pydantic body models and the error description."""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from pydantic import BaseModel, StrictStr, ValidationError

from gateway.invalid_fields import describe
from gateway.openai_schema import ChatBody, CompletionBody, EmbeddingBody
from gateway.responses_schema import ResponseBody
from gateway.schema import BatchSubmitBody, SubmitBody
from protocol.messages import GenerationParams
from protocol.model_state import routing_fraction
from protocol.utf8 import ERROR_TYPE, Utf8Json, Utf8Str, first_surrogate, mend_surrogates

BODIES: list[type[BaseModel]] = [
    ChatBody, CompletionBody, EmbeddingBody, ResponseBody, SubmitBody, BatchSubmitBody, GenerationParams,
]  # fmt: skip
"""Every model a caller's JSON is parsed into."""

_CHECKS = ("_utf8", "_utf8_json")


def _bare_strings(schema: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Where a pydantic core schema takes a str (or any JSON value) without the UTF-8 check around it."""
    if isinstance(schema, list | tuple):
        return [p for i, item in enumerate(schema) for p in _bare_strings(item, (*path, i))]
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    if not isinstance(kind, str):  # a mapping of names (fields), not a schema
        return [p for key, item in schema.items() for p in _bare_strings(item, (*path, key))]
    if kind == "function-before" and getattr(schema["function"]["function"], "__name__", "") in _CHECKS:
        return []
    if kind == "chain" and not _bare_strings(schema["steps"][0]):  # later steps (a pattern) get checked text
        return []
    if kind in ("str", "any"):
        return [path]
    skip = ("metadata", "serialization")  # a schema's own annotations, not what it validates
    return [p for key, item in schema.items() if key not in skip for p in _bare_strings(item, (*path, key))]


class _Unchecked(BaseModel):
    name: StrictStr
    extra: dict[str, Any]
    fine: Utf8Str
    blob: Utf8Json = None


def test_the_walker_finds_a_bare_string() -> None:
    found = _bare_strings(_Unchecked.__pydantic_core_schema__)
    assert {p[p.index("fields") + 1] for p in found} == {"name", "extra"}, found


@pytest.mark.parametrize("model", BODIES, ids=lambda m: m.__name__)
def test_no_body_takes_a_string_without_the_utf8_check(model: type[BaseModel]) -> None:
    assert _bare_strings(model.__pydantic_core_schema__) == []


M = "\x00mark\x00"
"""Where a case's body gets the text under test (a value, or a dict key)."""
CHAT = {"model": "demo-lm", "messages": [{"role": "user", "content": "hi"}]}
RESP = {"model": "demo-lm", "input": "hi"}
NATIVE = {"model": "demo-lm", "input_ids": [5]}

CASES: list[tuple[type[BaseModel], dict[str, Any], str]] = [
    # the OpenAI faces
    (ChatBody, {**CHAT, "model": M}, "model"),
    (ChatBody, {**CHAT, "user": M}, "user"),
    (ChatBody, {**CHAT, "stop": M}, "stop"),
    (ChatBody, {**CHAT, "stop": ["ok", M]}, "stop[1]"),
    (ChatBody, {**CHAT, "messages": [{"role": "user", "content": M}]}, "messages[0].content"),
    (ChatBody, {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": M}]}]},
     "messages[0].content[0].text"),
    (ChatBody, {**CHAT, "messages": [{"role": "user", "content": [{"type": M, "text": "x"}]}]},
     "messages[0].content[0].type"),
    (ChatBody, {**CHAT, "messages": [{"role": "user", "content": "hi", "name": M}]}, "messages[0].name"),
    (ChatBody, {**CHAT, "response_format": {"type": "text", "x": M}}, "response_format"),
    (ChatBody, {**CHAT, "tools": [{"type": "function", "function": {"name": M}}]}, "tools"),
    (ChatBody, {**CHAT, "tool_choice": {"function": {"name": M}}}, "tool_choice"),
    (ChatBody, {**CHAT, "logit_bias": {M: 1}}, "logit_bias"),
    (CompletionBody, {"model": "demo-lm", "prompt": M}, "prompt"),
    (CompletionBody, {"model": "demo-lm", "prompt": [M]}, "prompt[0]"),
    (CompletionBody, {"model": "demo-lm", "prompt": "hi", "suffix": M}, "suffix"),
    (CompletionBody, {"model": "demo-lm", "prompt": "hi", "user": M}, "user"),
    (EmbeddingBody, {"model": "demo-encoder", "input": M}, "input"),
    (EmbeddingBody, {"model": "demo-encoder", "input": ["ok", M]}, "input[1]"),
    (EmbeddingBody, {"model": "demo-encoder", "input": "hi", "user": M}, "user"),
    (EmbeddingBody, {"model": M, "input": "hi"}, "model"),
    # the Responses face
    (ResponseBody, {**RESP, "model": M}, "model"),
    (ResponseBody, {**RESP, "input": M}, "input"),
    (ResponseBody, {**RESP, "input": [{"role": "user", "content": M}]}, "input[0].content"),
    (ResponseBody, {**RESP, "input": [{"role": "user", "content": [{"type": "input_text", "text": M}]}]},
     "input[0].content[0].text"),
    (ResponseBody, {**RESP, "instructions": M}, "instructions"),
    (ResponseBody, {**RESP, "previous_response_id": M}, "previous_response_id"),
    (ResponseBody, {**RESP, "metadata": {"k": M}}, "metadata.k"),
    (ResponseBody, {**RESP, "metadata": {M: "v"}}, "metadata"),
    (ResponseBody, {**RESP, "user": M}, "user"),
    (ResponseBody, {**RESP, "text": {"format": {"type": "text"}, "verbosity": M}}, "text"),
    (ResponseBody, {**RESP, "tools": [{"name": M}]}, "tools"),
    (ResponseBody, {**RESP, "reasoning": {"effort": M}}, "reasoning"),
    (ResponseBody, {**RESP, "include": [M]}, "include"),
    # the native face
    (SubmitBody, {**NATIVE, "model": M}, "model"),
    (SubmitBody, {"model": "demo-lm", "text": M}, "text"),
    (SubmitBody, {**NATIVE, "request_id": M}, "request_id"),
    (SubmitBody, {**NATIVE, "routing_key": M}, "routing_key"),
    (SubmitBody, {**NATIVE, "output": {"generation": {"stop": [M]}}}, "output.generation.stop[0]"),
    (BatchSubmitBody, {"requests": [NATIVE, {**NATIVE, "routing_key": M}]}, "requests[1].routing_key"),
]


def put_text(body: Any, text: str) -> Any:
    """``body`` with :data:`M` (as a value or a key) replaced by ``text``."""
    if body == M:
        return text
    if isinstance(body, dict):
        return {(text if k == M else k): put_text(v, text) for k, v in body.items()}
    if isinstance(body, list):
        return [put_text(item, text) for item in body]
    return copy.deepcopy(body)


def _refusal(model: type[BaseModel], body: dict[str, Any]) -> tuple[str, str, set[str]]:
    """The field and message the gateway would answer ``body`` with, and the types of pydantic's errors."""
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    errors = info.value.errors()
    field, message = describe([{**e, "loc": ("body", *e["loc"])} for e in errors])  # as FastAPI locates them
    return field, message, {e["type"] for e in errors}


@pytest.mark.parametrize(("model", "body", "field"), CASES, ids=[f"{m.__name__}-{f}" for m, _, f in CASES])
def test_a_lone_surrogate_is_refused_naming_the_field_as_sent(
    model: type[BaseModel], body: dict[str, Any], field: str
) -> None:
    model.model_validate(put_text(body, "ok1"))  # the same body with valid text passes
    named, message, kinds = _refusal(model, put_text(body, "ab\ud800"))
    assert named == field and ERROR_TYPE in kinds, message
    assert "not valid Unicode: lone surrogate U+D800 at character 2" in message and "\ud800" not in message


texts = st.text(st.characters(exclude_categories=["Cs"]), max_size=8)  # decoded UTF-8: no surrogates
surrogates = st.integers(0xD800, 0xDFFF).map(chr)


# the example: a dict key holding "[" was taken for a union's form tag, and the field named was "body"
@given(case=st.sampled_from(CASES), before=texts, lone=surrogates, after=texts)
@example(case=next(c for c in CASES if c[2] == "logit_bias"), before="", lone="\ud800", after="[")
def test_any_lone_surrogate_anywhere_is_located(
    case: tuple[type[BaseModel], dict[str, Any], str], before: str, lone: str, after: str
) -> None:
    model, body, field = case
    named, message, _ = _refusal(model, put_text(body, before + lone + after))
    assert named == field, message
    assert f"not valid Unicode: lone surrogate U+{ord(lone):04X} at character {len(before)}" in message


@pytest.mark.parametrize(
    ("tools", "where"),
    [
        ([{"function": {"name": "\ud800"}}], "tools[0].function.name is"),
        ([{"function": {"\ud800": 1}}], "a key of tools[0].function is"),
    ],
)
def test_inside_a_json_field_the_message_says_where(tools: list[Any], where: str) -> None:
    field, message, _ = _refusal(ResponseBody, {**RESP, "tools": tools})
    assert field == "tools" and f"{where} not valid Unicode: lone surrogate U+D800 at character 0" in message, message


def test_a_surrogate_pair_is_one_character_and_fine() -> None:
    paired = "\ud83d\ude42".encode("utf-16", "surrogatepass").decode("utf-16")  # JSON's pair, joined: 🙂
    assert first_surrogate(paired) is None
    ResponseBody.model_validate({**RESP, "user": paired, "metadata": {paired: paired}})


def test_a_wrong_type_is_still_a_type_error() -> None:
    refused = _refusal(ResponseBody, {**RESP, "user": 5})
    assert refused[:2] == ("user", "invalid field user: Input should be a valid string"), refused
    _, message, _ = _refusal(CompletionBody, {"model": "m", "prompt": 5})
    assert message.endswith("matches none of its accepted forms (str, list[str], list[int], list[list[int]])")


@given(st.text(st.characters(), max_size=20))  # any str, lone surrogates included
def test_routing_fraction_never_raises(key: str) -> None:
    fraction = routing_fraction(key)
    assert 0 <= fraction < 1 and fraction == routing_fraction(key)


@pytest.mark.parametrize("key", ["session-42", "café-7", "用户-3", "\U0001f642", ""])
def test_routing_fraction_of_utf8_keys_is_unchanged(key: str) -> None:
    """Keys that were valid UTF-8 keep their canary side (the split stays sticky across the fix): the fraction
    is still the first 8 bytes of the sha256 of the key's UTF-8 bytes over 2**64, worked out here on its own."""
    assert routing_fraction(key) == int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") / 2**64


def test_mend_surrogates_replaces_each_lone_half_and_keeps_pairs_keys_and_clean_values() -> None:
    stored = json.loads('{"a\\ud800": ["x\\udfff y", 3, "\\ud83d\\ude42 ok", null, 1.5], "b": {"c": "\\udbff"}}')
    assert mend_surrogates(stored) == {"a\ufffd": ["x\ufffd y", 3, "\U0001f642 ok", None, 1.5], "b": {"c": "\ufffd"}}
    json.dumps(mend_surrogates(stored), ensure_ascii=False).encode()  # now encodes as UTF-8
    clean = {"k": ["v", "\U0001f642"]}
    assert mend_surrogates(clean) == clean and mend_surrogates("v") == "v"
