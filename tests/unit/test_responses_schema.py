"""The Responses API's body mapped onto chat-template messages, and its refusals (pure, no I/O)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from gateway.responses_schema import ResponseBody, check_supported, input_messages, message_item, output_message
from protocol.errors import InvalidRequest


def body(**fields: Any) -> ResponseBody:
    return ResponseBody.model_validate({"model": "demo-lm", **fields})


@pytest.mark.parametrize(
    ("given", "messages"),
    [
        ("Hi", [{"role": "user", "content": "Hi"}]),
        ([{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Hi"}]),
        (
            [
                {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be "},
                                                                     {"type": "input_text", "text": "brief."}]},
                {"role": "assistant", "content": [{"type": "output_text", "text": "ok", "annotations": []}]},
            ],
            [{"role": "developer", "content": "Be brief."}, {"role": "assistant", "content": "ok"}],
        ),
    ],
)  # fmt: skip
def test_input_becomes_chat_messages(given: Any, messages: list[dict[str, str]]) -> None:
    assert input_messages(body(input=given)) == messages


def test_non_text_parts_and_empty_input_are_refused_by_name() -> None:
    parts = [{"type": "input_text", "text": "a"}, {"type": "input_image", "image_url": "x"}]
    image = [{"role": "user", "content": parts}]
    with pytest.raises(InvalidRequest) as info:
        input_messages(body(input=image))
    assert info.value.field == "input[0].content[1].type"
    with pytest.raises(InvalidRequest) as empty:
        input_messages(body(input=[]))
    assert empty.value.field == "input"


def test_a_text_part_without_text_is_named_by_its_text() -> None:
    """Before: ``input[0].content[0].type = 'input_text': only text parts are supported``."""
    with pytest.raises(InvalidRequest) as info:
        input_messages(body(input=[{"role": "user", "content": [{"type": "input_text"}]}]))
    assert info.value.field == "input[0].content[0].text" and "required" in info.value.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"text": {"format": {"type": "json_object"}}}, "text.format"),
        ({"text": {"format": 5}}, "text.format"),
        ({"background": True}, "background"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"conversation": "conv_123"}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ],
)
def test_unsupported_fields_are_refused_by_name(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        check_supported(body(input="Hi", **fields))
    assert info.value.field == param
    if param not in ("tools", "tool_choice"):  # before, every refusal said "without tools or reasoning"
        assert "tools or reasoning" not in info.value.message


def test_supported_fields_pass_and_unknown_ones_do_not() -> None:
    check_supported(body(input="Hi", tool_choice="auto", text={"format": {"type": "text"}}, tools=[]))
    # the rest of OpenAI's Responses fields, as SDK code sets them when they change nothing the fleet does
    check_supported(body(input="Hi", service_tier="auto", prompt_cache_key="c-1", safety_identifier="u",
                         max_tool_calls=0, stream_options={"include_obfuscation": False}, top_logprobs=0,
                         text={"verbosity": "medium"}))
    with pytest.raises(ValidationError):
        body(input="Hi", frobnicate=1)
    with pytest.raises(ValidationError):
        body(input="Hi", max_output_tokens=0)


def test_items_carry_roles_and_part_types() -> None:
    assert message_item("m1", {"role": "user", "content": "Hi"})["content"] == [{"type": "input_text", "text": "Hi"}]
    answer = message_item("m2", {"role": "assistant", "content": "ok"})["content"][0]
    assert answer["type"] == "output_text" and answer["text"] == "ok"
    out = output_message("m3", "ok", "incomplete")
    assert out["role"] == "assistant" and out["status"] == "incomplete" and out["content"][0]["text"] == "ok"
