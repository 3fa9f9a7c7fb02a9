"""A body that failed validation is told the field as the caller sent it (gateway.invalid_fields), from the errors
pydantic gives for the gateway's real body models. Pure logic."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from gateway.invalid_fields import caller_path, describe
from gateway.openai_schema import ChatBody, CompletionBody
from gateway.responses_schema import ResponseBody


def _described(model: type[BaseModel], body: dict[str, Any]) -> tuple[str, str]:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return describe([{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()])  # as FastAPI locates them


@pytest.mark.parametrize(
    ("model", "body", "field", "words"),
    [
        (CompletionBody, {"model": "m", "prompt": 5}, "prompt",
         "matches none of its accepted forms (str, list[str], list[int], list[list[int]])"),
        (CompletionBody, {"model": "m", "prompt": [1, "a"]}, "prompt", "matches none of its accepted forms"),
        (CompletionBody, {"model": "m", "prompt": "x", "temperature": True}, "temperature", "valid number"),
        (ChatBody, {"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content",
         "matches none of its accepted forms"),
        # the value took one form (a list of parts): what is wrong is inside it
        (ChatBody, {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
         "messages[0].content[0].text", "valid string"),
        (ChatBody, {"model": "m", "messages": [{"role": "user", "content": "x", "frobnicate": []}]},
         "messages[0].frobnicate", "Extra inputs are not permitted"),  # tool_calls is OpenAI's: declared
        (ResponseBody, {"model": "m", "input": [{"role": "tool", "content": "x"}]}, "input[0].role", "Input should be"),
    ],
)
def test_a_field_is_named_as_sent_with_what_is_wrong(
    model: type[BaseModel], body: dict[str, Any], field: str, words: str
) -> None:
    named, message = _described(model, body)
    assert named == field and message.startswith(f"invalid field {field}: ") and words in message, message


def test_where_a_value_came_from_is_not_part_of_its_name() -> None:
    wait = [{"loc": ("query", "wait_s"), "msg": "Input should be greater than or equal to 0", "type": "x"}]
    assert describe(wait) == ("wait_s", "invalid field wait_s: Input should be greater than or equal to 0")
    whole = [{"loc": ("body",), "msg": "Field required", "type": "missing"}]
    assert describe(whole)[0] == "body"
    two = [{"loc": ("body", "a"), "msg": "bad", "type": "x"}, {"loc": ("body", "b"), "msg": "bad", "type": "x"}]
    assert describe(two) == ("a", "invalid field a: bad (and 1 more errors)")


def test_a_dict_key_is_a_field_not_a_form() -> None:
    """A user's own key (capitalised, say) of a dict field is part of the path, not a union's form."""
    errors = [{"loc": ("body", "metadata", "Owner"), "msg": "Input should be a valid string", "type": "string_type"}]
    assert describe(errors)[0] == "metadata.Owner"


def test_caller_path_writes_indexes_in_brackets() -> None:
    assert caller_path(("messages", 0, "content", 1, "text")) == "messages[0].content[1].text"
    assert caller_path((2,)) == "[2]" and caller_path(()) == ""


def test_an_error_from_a_bound_carries_the_bound_as_its_limit() -> None:
    """Every fleet error carries ``limit`` beside ``field``; a value past a pydantic bound gave ``"limit": null``."""
    from protocol.messages import GenerationParams, as_invalid_request, limit_of

    with pytest.raises(ValidationError) as info:
        GenerationParams.model_validate({"max_new_tokens": 0})
    err = as_invalid_request(info.value, prefix="output.generation")
    assert (err.field, err.limit) == ("output.generation.max_new_tokens", 1)
    with pytest.raises(ValidationError) as info:
        CompletionBody.model_validate({"model": "m", "prompt": "x", "temperature": 3})
    assert limit_of(info.value.errors()[0]) == 2
    assert limit_of({"msg": "x"}) is None


def test_a_generation_that_does_not_fit_names_what_must_change() -> None:
    """Too many tokens asked: ``max_new_tokens`` is named with what fits. A prompt that leaves no room for one
    token: the prompt is named (each face renames ``input_ids``: ``prompt``, ``messages``, ``input``) with the
    longest that leaves room; before, the caller was told to change a ``max_tokens`` it may never have sent."""
    from protocol.errors import InvalidRequest
    from protocol.validation import check_generation_room

    with pytest.raises(InvalidRequest) as info:
        check_generation_room(60, 10, max_positions=512, max_kv_tokens=64)
    assert (info.value.field, info.value.limit) == ("output.generation.max_new_tokens", 4)
    for prompt in (64, 100):
        with pytest.raises(InvalidRequest, match="no room for one: it must be shorter than 64 tokens") as info:
            check_generation_room(prompt, 1, max_positions=512, max_kv_tokens=64)
        assert (info.value.field, info.value.limit) == ("input_ids", 63)
    check_generation_room(63, 1, max_positions=512, max_kv_tokens=64)  # fits: nothing raised


def test_a_generation_past_the_models_positions_is_a_context_length_error_named_as_the_caller_named_it() -> None:
    """Past the model's positions the error is InputTooLong (OpenAI's ``context_length_exceeded``, which clients
    test to trim and retry; it was a plain invalid_request) and its message names the field in full, so the
    OpenAI faces rename it in the message too: it said ``max_new_tokens`` to a caller who sent ``max_tokens``."""
    from gateway.openai_params import rename_field
    from protocol.errors import InputTooLong, InvalidRequest
    from protocol.validation import check_generation_room

    with pytest.raises(InvalidRequest) as info:
        check_generation_room(400, 200, max_positions=512, max_kv_tokens=32_768)
    assert type(info.value) is InputTooLong and info.value.code == "input_too_long", info.value
    renamed = rename_field(info.value, {"output.generation.max_new_tokens": "max_tokens"})
    assert (renamed.field, renamed.limit) == ("max_tokens", 112), renamed
    assert "+ max_tokens (200) = 600 exceeds the model's max_positions=512" in renamed.message, renamed.message
    assert "max_new_tokens" not in renamed.message
    with pytest.raises(InvalidRequest) as budget:  # the worker's KV budget: a capacity of the fleet's
        check_generation_room(40, 40, max_positions=512, max_kv_tokens=64)
    assert type(budget.value) is InvalidRequest, budget.value
