"""The body of ``POST /v1/responses`` as OpenAI names it, and the pure mapping of a Responses call onto
the chat face (no I/O).

A Responses call is a chat completion whose conversation is ``instructions`` (a ``system`` message,
this turn's only: OpenAI does not carry a previous response's instructions over), the stored
history of ``previous_response_id`` (every earlier turn's input and output messages), and this turn's
``input`` (a text = one user message, or a list of messages with ``input_text``/``output_text``
parts). Fields the fleet cannot honour (``tools``, ``reasoning``, a non-text ``text.format``,
``text.verbosity``, ``background``, ``include``, ``top_logprobs``, ``conversation``, ``prompt``, non-text
parts) are refused with a 400 naming them; those that change nothing here (``service_tier``,
``prompt_cache_key``, ``safety_identifier``, ``max_tool_calls``, ``stream_options``) are accepted and
ignored; an unknown field is a 400 too, and so is a string that cannot be encoded as UTF-8
(:mod:`protocol.utf8`), before anything runs or is stored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from gateway.openai_schema import (
    METADATA_KEY_CHARS,
    METADATA_PAIRS,
    METADATA_VALUE_CHARS,
    USER_CHARS,
    EndUser,
    Metadata,
)
from protocol.errors import InvalidRequest
from protocol.messages import RequestFloat
from protocol.utf8 import UTF8_STRINGS, Utf8Json, Utf8Str

__all__ = [
    "InputMessage",
    "ResponseBody",
    "TextPart",
    "check_supported",
    "input_messages",
    "message_item",
    "output_message",
]


class TextPart(BaseModel):
    """One content part; only text (``input_text``, ``output_text``, ``text``) is supported."""

    model_config = ConfigDict(extra="allow")

    type: Utf8Str
    text: Utf8Str | None = None


class InputMessage(BaseModel):
    """One input item: a message (``type`` "message" or absent, as the SDKs' easy input sends it)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Utf8Str | list[TextPart]


class ResponseBody(BaseModel):
    """``POST /v1/responses``."""

    model_config = ConfigDict(extra="forbid")

    model: Utf8Str = Field(min_length=1, max_length=200, examples=["demo-lm"])
    input: Utf8Str | list[InputMessage] = Field(description="A text (one user message) or a list of messages.")
    instructions: Utf8Str | None = Field(default=None, description="A system message for this turn only.")
    previous_response_id: Utf8Str | None = Field(default=None, max_length=200)
    store: StrictBool | None = Field(default=True, description="Keep the response (api.responses_ttl_s).")
    max_output_tokens: StrictInt | None = Field(default=None, ge=1, description="-> max_new_tokens.")
    temperature: RequestFloat | None = Field(default=None, ge=0, le=2, description="0 = greedy.")
    top_p: RequestFloat | None = Field(default=None, ge=0, le=1, description="0 = the most likely token (greedy).")
    stream: StrictBool | None = False
    metadata: Metadata | None = Field(
        default=None, description=f"Stored and returned as given: at most {METADATA_PAIRS} pairs, keys of at most "
        f"{METADATA_KEY_CHARS} characters, values {METADATA_VALUE_CHARS} (OpenAI's bounds).",
    )
    user: EndUser | None = Field(
        default=None, description=f"End-user ID: the sticky key of a canary split; stored. At most {USER_CHARS} "
        "characters.",
    )
    truncation: Literal["disabled"] | None = Field(default=None, description="Only 'disabled'.")
    parallel_tool_calls: StrictBool | None = Field(default=None, description="Accepted and ignored.")
    max_tool_calls: StrictInt | None = Field(default=None, ge=0, description="Accepted and ignored: no tools run.")
    service_tier: Utf8Str | None = Field(default=None, description="Accepted and ignored: one tier.")
    prompt_cache_key: Utf8Str | None = Field(
        default=None, description="Accepted and ignored: prefix reuse is automatic (prefix-aware routing)."
    )
    safety_identifier: Utf8Str | None = Field(default=None, description="Accepted and ignored.")
    stream_options: Annotated[dict[str, Any] | None, UTF8_STRINGS] = Field(
        default=None, description="Accepted and ignored (include_obfuscation: the fleet adds no padding)."
    )
    # refused unless empty (see check_supported)
    top_logprobs: StrictInt | None = None
    conversation: Utf8Json = None
    prompt: Utf8Json = None
    tools: Annotated[list[Any] | None, UTF8_STRINGS] = None
    tool_choice: Utf8Json = None
    reasoning: Annotated[dict[str, Any] | None, UTF8_STRINGS] = None
    text: Annotated[dict[str, Any] | None, UTF8_STRINGS] = None
    background: StrictBool | None = None
    include: Annotated[list[Any] | None, UTF8_STRINGS] = None


def _refuse(field: str, value: Any, why: str) -> InvalidRequest:
    return InvalidRequest(f"{field} = {value!r} is not supported: {why}", field, None)


def check_supported(body: ResponseBody) -> None:
    """Refuse the Responses fields the fleet cannot honour.

    Raises:
        InvalidRequest: naming the first such field (``tools``, ``reasoning``, ``text.format``, …).
    """
    given = (body.text or {}).get("format")
    fmt = given.get("type", "text") if isinstance(given, dict) else ("text" if given is None else given)
    checks = {
        "tools": bool(body.tools),
        "tool_choice": body.tool_choice not in (None, "none", "auto"),
        "reasoning": bool(body.reasoning),
        "text.format": fmt != "text",
        "background": bool(body.background),
        "include": bool(body.include),
        "text.verbosity": (body.text or {}).get("verbosity") not in (None, "medium"),
        "top_logprobs": body.top_logprobs not in (None, 0),
        "conversation": body.conversation is not None,
        "prompt": body.prompt is not None,
    }
    for name, refused in checks.items():
        if refused:
            value = {"text.format": fmt, "text.verbosity": (body.text or {}).get("verbosity")}.get(name) \
                if name.startswith("text.") else getattr(body, name)
            raise _refuse(name, value, _WHY_REFUSED[name])


_WHY_REFUSED = {
    "tools": "the fleet has no tools or function calling; the model answers in plain text",
    "tool_choice": "the fleet has no tools or function calling; only 'none' or 'auto'",
    "reasoning": "the fleet's models have no reasoning settings",
    "text.format": "the fleet has no constrained (JSON) decoding; only {'type': 'text'}",
    "background": "a response is answered while the call waits; poll GET /v1/requests/{id} for a long one",
    "include": "the fleet's responses carry no extra output data to include",
    "text.verbosity": "the answer's length is max_output_tokens, not a verbosity level; only 'medium'",
    "top_logprobs": "the fleet returns plain text without log-probabilities",
    "conversation": "no Conversations API; continue a conversation with previous_response_id",
    "prompt": "no stored prompt templates; send the input",
}
"""Why each field :func:`check_supported` refuses cannot be honoured, as the 400 says it."""


def _text_of(content: str | list[TextPart], where: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if part.type not in ("input_text", "output_text", "text"):
            raise InvalidRequest(
                f"{where}.content[{j}].type = {part.type!r}: only text parts are supported",
                f"{where}.content[{j}].type",
                "input_text",
            )
        if part.text is None:
            raise InvalidRequest(f"{where}.content[{j}].text is required in a text part",
                                 f"{where}.content[{j}].text", "a string")  # fmt: skip
        parts.append(part.text)
    return "".join(parts)


def input_messages(body: ResponseBody) -> list[dict[str, str]]:
    """This turn's input as chat-template messages (``{"role", "content"}``, content text).

    Raises:
        InvalidRequest: an empty input, or a content part that is not text (field ``input[i]...``).
    """
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    if not body.input:
        raise InvalidRequest("input is empty: give a text or at least one message", "input", 1)
    return [{"role": m.role, "content": _text_of(m.content, f"input[{i}]")} for i, m in enumerate(body.input)]


def message_item(item_id: str, message: dict[str, str]) -> dict[str, Any]:
    """One input message as an item of ``GET /v1/responses/{id}/input_items``."""
    kind = "output_text" if message["role"] == "assistant" else "input_text"
    part: dict[str, Any] = {"type": kind, "text": message["content"]}
    if kind == "output_text":
        part["annotations"] = []
    return {"id": item_id, "type": "message", "role": message["role"], "status": "completed", "content": [part]}


def output_message(item_id: str, text: str, status: str) -> dict[str, Any]:
    """The assistant's answer as a Responses output item."""
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [part]}
