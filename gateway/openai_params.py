"""OpenAI's sampling fields into the fleet's :class:`GenerationParams` (pure: no I/O), and the fleet's
field names back into the caller's in an error (``output.generation.max_new_tokens`` → ``max_tokens``).

Which field maps to which, and OpenAI's defaults (temperature 1, ``max_tokens`` 16 on completions):
:mod:`gateway.openai_mapping`.
"""

from __future__ import annotations

import re
from typing import Any, Literal, TypeVar

from pydantic import ValidationError

from gateway.openai_schema import ChatBody, CompletionBody
from protocol.errors import FleetError, InvalidRequest
from protocol.messages import GenerationParams, as_invalid_request

__all__ = [
    "COMPLETIONS_DEFAULT_MAX_TOKENS",
    "DEFAULT_TEMPERATURE",
    "Face",
    "generation_fallbacks",
    "generation_params",
    "max_tokens_field",
    "rename_field",
    "wrong_kind",
]

DEFAULT_TEMPERATURE = 1.0
"""OpenAI's default temperature."""
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for ``/v1/completions``."""

Face = Literal["completion", "chat"]
E = TypeVar("E", bound=FleetError)


def max_tokens_field(body: CompletionBody | ChatBody) -> str:
    """The field that caps the body's length as the caller named it: chat's ``max_completion_tokens``
    when given, else ``max_tokens``."""
    return "max_completion_tokens" if isinstance(body, ChatBody) and body.max_completion_tokens else "max_tokens"


def generation_params(body: CompletionBody | ChatBody) -> GenerationParams:
    """The fleet's sampling parameters that ``body`` sets (``stream`` always, from ``body.stream``).

    Only the fields the caller sent are set (``model_fields_set``): the rest are resolved where every
    face resolves them (:meth:`producer.client.FleetClient.build_request`: the model's
    ``generation_config.json``, else :func:`generation_fallbacks`).

    Raises:
        InvalidRequest: a value out of the fleet's range, naming the OpenAI field.
    """
    max_field = max_tokens_field(body)
    nucleus_of_one = body.top_p == 0  # OpenAI allows 0: the smallest nucleus, the most likely token alone
    fields: dict[str, Any] = {
        "max_new_tokens": getattr(body, max_field),
        "temperature": 0.0 if nucleus_of_one else body.temperature,
        "top_p": None if nucleus_of_one else body.top_p,
        "seed": None if body.seed is None else body.seed % 2**63,  # OpenAI's int64; the fleet's seeds are >= 0
        "stop": [body.stop] if isinstance(body.stop, str) else body.stop,
        "top_k": body.top_k,
        "repetition_penalty": body.repetition_penalty,
        "ignore_eos": body.ignore_eos,
        "stop_token_ids": body.stop_token_ids,
        "stream": bool(body.stream),
    }
    try:
        return GenerationParams.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        raise rename_field(as_invalid_request(exc), {"max_new_tokens": max_field}) from exc


def generation_fallbacks(face: Face, chat_max_new_tokens: int) -> dict[str, Any]:
    """OpenAI's own defaults, for what neither the caller nor the model's ``generation_config.json`` sets:
    temperature 1, and ``max_tokens`` 16 on completions, ``chat_max_new_tokens`` (the model's limit) on
    chat."""
    max_new = COMPLETIONS_DEFAULT_MAX_TOKENS if face == "completion" else chat_max_new_tokens
    return {"temperature": DEFAULT_TEMPERATURE, "max_new_tokens": max_new}


def rename_field(exc: E, names: dict[str, str], prefix: str = "") -> E:
    """An InvalidRequest ``exc`` with its field named as the caller named it: ``prefix`` stripped, then
    ``names`` applied to the whole field, else to its first name (``output.generation.max_new_tokens``
    → ``max_tokens``, ``input_ids[3]`` → ``prompt[3]``); a renamed first name is renamed in the message
    too. Other errors come back as they are."""
    if not isinstance(exc, InvalidRequest) or not exc.field:
        return exc
    field = exc.field[len(prefix) :] if prefix and exc.field.startswith(prefix) else exc.field
    if field in names:  # the message names the field as the error did (output.generation.max_new_tokens = …)
        return type(exc)(exc.message.replace(exc.field, names[field]), names[field], exc.limit)
    head = re.match(r"[A-Za-z_]*", field).group()  # type: ignore[union-attr]  # always matches
    renamed = names.get(head, head) + field[len(head) :]
    return type(exc)(exc.message.replace(exc.field, renamed), renamed, exc.limit)


def wrong_kind(exc: E, model: str, task: str, instead: str) -> E | InvalidRequest:
    """``exc`` unless it says the model cannot produce what the route answers with (field ``output.kind``):
    then that, named ``model``: ``model`` cannot ``task`` (``generate text``), why, and ``instead`` (the
    route that serves such a model)."""
    if not isinstance(exc, InvalidRequest) or exc.field != "output.kind":
        return exc
    why = exc.message.split(": ", 1)[-1]
    return InvalidRequest(f"model {model!r} cannot {task}: {why}; {instead}", "model", exc.limit)
