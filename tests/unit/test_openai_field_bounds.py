"""OpenAI's bounds on ``metadata`` (16 pairs, keys of 64 characters, values of 512) and the fleet's on ``user``
(256 characters), one definition for every OpenAI body that takes them: chat completions (where they are ignored),
completions and embeddings (``user``: a canary's sticky key) and responses (which stores both for
``api.responses_ttl_s``). A value past a bound is refused naming the field and the limit, as the error handler
reports it (:func:`gateway.invalid_fields.describe`, :func:`protocol.messages.limit_of`); the bounds themselves pass.

Before: a response stored ``metadata`` of 500 keys of 500 characters (a 256 KB Redis key, for 30 days) and a
``user`` of 900,000 characters, answering 200.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from gateway.invalid_fields import describe
from gateway.openai_schema import (
    METADATA_KEY_CHARS,
    METADATA_PAIRS,
    METADATA_VALUE_CHARS,
    USER_CHARS,
    ChatBody,
    CompletionBody,
    EmbeddingBody,
)
from gateway.responses_schema import ResponseBody
from protocol.messages import limit_of

BODIES: dict[type[BaseModel], dict[str, Any]] = {
    ChatBody: {"model": "m", "messages": [{"role": "user", "content": "Hi"}]},
    ResponseBody: {"model": "m", "input": "Hi"},
    CompletionBody: {"model": "m", "prompt": "Hi"},
    EmbeddingBody: {"model": "m", "input": "Hi"},
}
WITH_METADATA: tuple[type[BaseModel], ...] = (ChatBody, ResponseBody)
AT_THE_BOUNDS = {f"k{i:02d}".ljust(METADATA_KEY_CHARS, "k"): "v" * METADATA_VALUE_CHARS for i in range(METADATA_PAIRS)}


def _refusal(model: type[BaseModel], fields: dict[str, Any]) -> tuple[str, str, Any]:
    """The field, message and limit a 400 names for ``fields``, as the gateway's error handler builds them."""
    with pytest.raises(ValidationError) as info:
        model.model_validate({**BODIES[model], **fields})
    errors = [{**error, "loc": ("body", *error["loc"])} for error in info.value.errors()]  # as FastAPI locates them
    field, message = describe(errors)
    return field, message, limit_of(errors[0])


@pytest.mark.parametrize("model", WITH_METADATA)
@pytest.mark.parametrize(
    ("metadata", "field", "limit", "words"),
    [
        ({f"k{i}": "v" * 500 for i in range(500)}, "metadata", METADATA_PAIRS, "at most 16 items"),
        ({**dict(list(AT_THE_BOUNDS.items())[:-1]), "x": "v", "y": "v"}, "metadata", METADATA_PAIRS, "16 items"),
        ({"k" * (METADATA_KEY_CHARS + 1): "v"}, "metadata", METADATA_KEY_CHARS, "(a key): String should have at most"),
        ({"team": "v" * (METADATA_VALUE_CHARS + 1)}, "metadata.team", METADATA_VALUE_CHARS, "at most 512 characters"),
    ],
)
def test_metadata_past_openai_s_bounds_is_refused_naming_the_field_and_the_limit(
    model: type[BaseModel], metadata: dict[str, str], field: str, limit: int, words: str
) -> None:
    named, message, bound = _refusal(model, {"metadata": metadata})
    assert (named, bound) == (field, limit), message
    assert words in message, message


@pytest.mark.parametrize("model", list(BODIES))
def test_a_user_past_its_bound_is_refused_naming_the_field_and_the_limit(model: type[BaseModel]) -> None:
    for user in ("u" * (USER_CHARS + 1), "u" * 900_000):
        field, message, limit = _refusal(model, {"user": user})
        assert (field, limit) == ("user", USER_CHARS), message
        assert f"at most {USER_CHARS} characters" in message, message


@pytest.mark.parametrize("model", list(BODIES))
def test_values_at_the_bounds_pass(model: type[BaseModel]) -> None:
    fields: dict[str, Any] = {"user": "u" * USER_CHARS}
    if model in WITH_METADATA:
        fields["metadata"] = AT_THE_BOUNDS
    parsed = model.model_validate({**BODIES[model], **fields})
    assert parsed.model_dump(include=set(fields)) == fields


@pytest.mark.parametrize("model", WITH_METADATA)
def test_a_lone_surrogate_in_metadata_is_still_refused_as_such(model: type[BaseModel]) -> None:
    """The bounds sit beside the UTF-8 check (:mod:`protocol.utf8`), which still speaks first."""
    field, message, _ = _refusal(model, {"metadata": {"team": "\ud800"}})
    assert field == "metadata.team" and "lone surrogate U+D800" in message, message


def test_the_bounds_are_in_the_openapi_document() -> None:
    for model in WITH_METADATA:
        metadata = model.model_json_schema()["properties"]["metadata"]["anyOf"][0]
        assert (metadata["maxProperties"], metadata["propertyNames"]["maxLength"]) == (
            METADATA_PAIRS, METADATA_KEY_CHARS), metadata
        assert metadata["additionalProperties"]["maxLength"] == METADATA_VALUE_CHARS, metadata
    for model in BODIES:
        assert model.model_json_schema()["properties"]["user"]["anyOf"][0]["maxLength"] == USER_CHARS
