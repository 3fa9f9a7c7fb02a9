"""The OpenAI fields the fleet cannot honour, refused before anything is built (pure: no I/O).

:func:`check_supported` raises InvalidRequest (400) naming the first such field of a completions, chat
or embeddings body, with why it cannot be honoured (:data:`_WHY_REFUSED`). The fields, and how the rest
map onto the fleet's own: :mod:`gateway.openai_mapping`.
"""

from __future__ import annotations

from typing import Any

from gateway.openai_schema import ChatBody, CompletionBody, EmbeddingBody
from protocol.errors import InvalidRequest

__all__ = ["check_supported"]


def _refuse(field: str, value: Any, why: str, limit: Any = None) -> InvalidRequest:
    return InvalidRequest(f"{field} = {value!r} is not supported: {why}", field, limit)


def check_supported(body: CompletionBody | ChatBody | EmbeddingBody) -> None:
    """Refuse the OpenAI fields the fleet cannot honour.

    Raises:
        InvalidRequest: naming the first such field (``n``, ``frequency_penalty``, ``tools``, …).
    """
    if isinstance(body, EmbeddingBody):
        if body.dimensions is not None:
            raise _refuse("dimensions", body.dimensions, "embeddings have the model's own size")
        return
    if body.n not in (None, 1):
        raise _refuse("n", body.n, "one choice per request (n=1); send separate requests", 1)
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(body, name)
        if value not in (None, 0):
            raise _refuse(name, value, "only 0; the fleet's repetition_penalty (in the body) penalises repeats", 0)
    if body.logit_bias:
        raise _refuse("logit_bias", body.logit_bias, "no logit bias")
    if body.stream_options is not None and not body.stream:  # as OpenAI answers
        raise InvalidRequest("stream_options is only allowed when stream is true", "stream_options", "stream: true")
    if isinstance(body, CompletionBody):
        checks = {"best_of": body.best_of not in (None, 1), "echo": bool(body.echo)}
        checks |= {"logprobs": body.logprobs is not None, "suffix": body.suffix is not None}
    else:
        if body.response_format is not None and "type" not in body.response_format:  # as OpenAI answers
            raise InvalidRequest("response_format.type is required: {'type': 'text'} is the one the fleet serves",
                                 "response_format.type", "text")  # fmt: skip
        fmt = (body.response_format or {}).get("type", "text")
        checks = {"logprobs": bool(body.logprobs), "top_logprobs": body.top_logprobs is not None}
        checks |= {"tools": bool(body.tools), "tool_choice": body.tool_choice not in (None, "none")}
        checks |= {"response_format": fmt != "text", "store": bool(body.store)}
        checks |= {"modalities": body.modalities not in (None, ["text"])}
        checks |= {name: getattr(body, name) is not None for name in _NULL_ONLY}
        checks |= {"functions": bool(body.functions), "function_call": body.function_call not in (None, "none")}
    for name, refused in checks.items():
        if refused:
            raise _refuse(name, getattr(body, name), _WHY_REFUSED[name])


_WHY_REFUSED = {
    "best_of": "one generation per request (best_of=1); send separate requests",
    "echo": "the answer holds the generated text only, not the prompt",
    "logprobs": "the fleet returns plain text without log-probabilities",
    "top_logprobs": "the fleet returns plain text without log-probabilities",
    "suffix": "no insertion (fill-in-the-middle); the prompt is a prefix",
    "tools": "the fleet has no tool or function calling; the model answers in plain text",
    "tool_choice": "the fleet has no tool or function calling; only 'none'",
    "response_format": "the fleet has no constrained (JSON) decoding; only {'type': 'text'}",
    "store": "no chat completion is kept to be read back; /v1/responses stores its answers",
    "modalities": "the fleet answers in text only; only ['text']",
    "reasoning_effort": "the fleet's models do not reason before answering",
    "verbosity": "the answer's length is max_tokens (or max_completion_tokens), not a verbosity level",
    "prediction": "no predicted outputs",
    "audio": "the fleet answers in text only",
    "web_search_options": "the fleet has no web search",
    "functions": "the fleet has no tool or function calling; the model answers in plain text",
    "function_call": "the fleet has no tool or function calling; only 'none'",
}
"""Why each field :func:`check_supported` refuses cannot be honoured, as the 400 says it."""
_NULL_ONLY = ("reasoning_effort", "verbosity", "prediction", "audio", "web_search_options")
"""Chat fields refused whenever they are sent with a value."""
