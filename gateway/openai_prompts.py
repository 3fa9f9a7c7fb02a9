"""An OpenAI body's prompts as the fleet takes them (pure: no I/O): a completion's one prompt, a chat's
messages as a chat template sees them, an embeddings body's inputs, and the field names the caller used
for each (``prompt``, ``prompt[0]``, ``input[i]``, ``messages[i].content``), so a refusal names them.

Each function raises InvalidRequest naming the field for what OpenAI refuses too (several prompts, an
empty input, a non-text content part) or the fleet cannot render (a tool call in a message).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gateway.openai_schema import ChatBody, ChatMessage, CompletionBody, EmbeddingBody
from protocol.errors import InvalidRequest

__all__ = ["Prompt", "chat_messages", "completion_prompt", "embedding_inputs", "input_field", "prompt_field"]

Prompt = tuple[list[int] | None, str | None]
"""One prompt: ``(token ids, None)`` or ``(None, text)``."""


def _one(items: Sequence[Any], field: str) -> Any:
    if len(items) != 1:
        raise InvalidRequest(f"{field} holds {len(items)} prompts; send one prompt per request", field, 1)
    return items[0]


def completion_prompt(body: CompletionBody) -> Prompt:
    """The one prompt of a completion: text, token ids, or a list of exactly one of either.

    Raises:
        InvalidRequest: several prompts, or none (field ``prompt``).
    """
    prompt = body.prompt
    if isinstance(prompt, str):
        return None, prompt
    if prompt and all(isinstance(p, int) for p in prompt):
        return list(prompt), None  # type: ignore[arg-type]
    first = _one(prompt, "prompt")
    return (None, first) if isinstance(first, str) else (list(first), None)


def _flat(given: Any) -> bool:
    """A text or one flat list of token ids (not a list of prompts)."""
    return isinstance(given, str) or all(isinstance(x, int) for x in given)


def prompt_field(body: CompletionBody) -> str:
    """The completion's prompt as the caller named it: ``prompt``, or ``prompt[0]`` inside a list of one."""
    return "prompt" if _flat(body.prompt) else "prompt[0]"


def input_field(body: EmbeddingBody, i: int) -> str:
    """Input ``i`` of an embeddings body as the caller named it: ``input`` for a text or one list of token
    ids, else ``input[i]``."""
    return "input" if _flat(body.input) else f"input[{i}]"


def _text_of(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for j, part in enumerate(content):
        if part.type != "text":
            raise InvalidRequest(
                f"{where}.content[{j}].type = {part.type!r}: only text parts are supported",
                f"{where}.content[{j}].type",
                "text",
            )
        if part.text is None:
            raise InvalidRequest(f"{where}.content[{j}].text is required in a text part",
                                 f"{where}.content[{j}].text", "a string")  # fmt: skip
        parts.append(part.text)
    return "".join(parts)


_NOT_RENDERED = {
    "tool_calls": "the fleet has no tool calling, so a conversation cannot hold a tool call",
    "function_call": "the fleet has no function calling, so a conversation cannot hold a function call",
    "audio": "the fleet answers in text; an earlier audio answer cannot be sent back",
    "refusal": "the chat template renders content only; send the refusal's text as content",
}
"""A message's fields the SDKs give back (null as a rule) that the fleet cannot render when they hold something."""


def _refuse_unrendered(message: ChatMessage, where: str) -> None:
    for name, why in _NOT_RENDERED.items():
        value = getattr(message, name)
        if value not in (None, []):
            raise InvalidRequest(f"{where}.{name} = {value!r} is not supported: {why}", f"{where}.{name}", None)


def chat_messages(body: ChatBody) -> list[dict[str, Any]]:
    """The conversation as a chat template sees it: ``{"role", "content"}`` (+ ``name``), content text.

    Raises:
        InvalidRequest: a content part that is not text (image, audio, …), a text part without text, no
            content where OpenAI requires it (every role but ``assistant``), content that is an empty list of
            parts (OpenAI refuses it for every role), a ``tool`` message without ``tool_call_id`` (OpenAI
            requires it), or a tool call, function call,
            audio or refusal in a message (:data:`_NOT_RENDERED`), naming it.
    """
    out = []
    for i, message in enumerate(body.messages):
        where = f"messages[{i}]"
        if message.content is None and message.role != "assistant":  # as OpenAI: only an assistant turn may omit it
            raise InvalidRequest(f"{where}.content is required for a {message.role!r} message",
                                 f"{where}.content", "a string or text parts")  # fmt: skip
        if message.content == []:  # as OpenAI: a list of parts has at least one
            raise InvalidRequest(f"{where}.content is an empty array: give a string or at least one text part",
                                 f"{where}.content", 1)  # fmt: skip
        if message.role == "tool" and not message.tool_call_id:  # as OpenAI: a tool message answers one call
            raise InvalidRequest(f"{where}.tool_call_id is required for a 'tool' message: the ID of the call it "
                                 "answers", f"{where}.tool_call_id", "a string")  # fmt: skip
        _refuse_unrendered(message, where)
        item = {"role": message.role, "content": _text_of(message.content, where)}
        for name in ("name", "tool_call_id"):
            if getattr(message, name) is not None:
                item[name] = getattr(message, name)
        out.append(item)
    return out


def embedding_inputs(body: EmbeddingBody) -> list[Prompt]:
    """One prompt per vector asked for.

    Raises:
        InvalidRequest: an empty ``input`` (``""``, ``[]``), or an empty text or token list in it
            (field ``input[i]``), as OpenAI refuses them; never a vector of no tokens.
    """
    given = body.input
    if isinstance(given, str):
        given = [given]
    if not given:
        raise InvalidRequest("input is empty: give a text, texts, token ids or lists of token ids", "input", 1)
    if all(isinstance(x, int) for x in given):
        return [(list(given), None)]  # type: ignore[arg-type]
    for i, item in enumerate(given):
        if not item:
            field = input_field(body, i)
            what = "an empty string" if isinstance(item, str) else "an empty list of token ids"
            raise InvalidRequest(f"{field} is {what}: every input needs at least one character or token", field, 1)
    return [(None, x) if isinstance(x, str) else (list(x), None) for x in given]  # type: ignore[arg-type]
