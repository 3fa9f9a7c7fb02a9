"""Every number a request carries is a JSON number and finite, on every face (the OpenAI, Responses and native
bodies, the Celery contract's request): ``true`` was read as 1 (``temperature: true`` sampled at temperature 1),
``"0.5"`` as 0.5, and ``-Infinity`` as a submit time (a result with ``queue_wait_ms: Infinity``, not JSON).
Found by walking the models' fields, so a float field added later is covered too. Pure logic."""

from __future__ import annotations

import json
import math
import types
import typing
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from gateway.openai_schema import ChatBody, CompletionBody
from gateway.responses_schema import ResponseBody
from gateway.schema import SubmitBody
from protocol.messages import GenerationParams, InferenceRequest

BODIES: dict[type[BaseModel], dict[str, Any]] = {
    CompletionBody: {"model": "m", "prompt": "x"},
    ChatBody: {"model": "m", "messages": [{"role": "user", "content": "x"}]},
    ResponseBody: {"model": "m", "input": "x"},
    SubmitBody: {"model": "m", "input_ids": [1]},
    GenerationParams: {},
    InferenceRequest: {"model": "m", "input_ids": [1], "request_id": "r"},
}


def _takes_float(annotation: Any) -> bool:
    if annotation is float:
        return True
    return any(_takes_float(arg) for arg in typing.get_args(annotation)) if typing.get_args(annotation) else False


def _float_fields() -> list[tuple[type[BaseModel], str]]:
    found = [(model, name) for model in BODIES for name, field in model.model_fields.items()
             if _takes_float(field.annotation) and not isinstance(field.annotation, types.GenericAlias)]  # fmt: skip
    assert len(found) >= 12, found  # temperature, top_p, penalties, deadlines, submit time, on every face
    return found


@pytest.mark.parametrize(("model", "name"), _float_fields(), ids=lambda x: getattr(x, "__name__", x))
@pytest.mark.parametrize("value", [True, "0.5", "NaN", "Infinity", "-Infinity"])
def test_a_request_number_is_a_finite_json_number(model: type[BaseModel], name: str, value: Any) -> None:
    body = json.dumps({**BODIES[model], name: value})
    if isinstance(value, str) and value.lstrip("-") in ("NaN", "Infinity"):
        body = body.replace(f'"{value}"', value)  # the bare JSON extension Python's json reads
        assert math.isnan(json.loads(body)[name]) or math.isinf(json.loads(body)[name])
    with pytest.raises(ValidationError) as info:
        model.model_validate_json(body)
    assert any(e["loc"][0] == name for e in info.value.errors()), info.value.errors()
