"""OpenAI requests into the fleet's own, and the fleet's results and stream events back (pure: no I/O).

Requests
    ``max_tokens`` (chat: ``max_completion_tokens`` first) → ``max_new_tokens``. A field the caller
    leaves unset takes the model's ``generation_config.json`` default (as every face does), else
    OpenAI's: ``max_tokens`` 16 on ``/v1/completions``, the model's ``limits.max_new_tokens`` on chat
    (a default is cut to what fits beside the prompt), temperature 1.
    ``temperature`` (0 = greedy), ``top_p`` (0 = greedy, as OpenAI allows), ``seed`` (default 0: the fleet's
    sampling is always seeded, so equal requests give equal tokens), ``stop`` (a string or a list)
    map one to one, as do the fleet extensions ``top_k``, ``repetition_penalty``, ``ignore_eos``,
    ``stop_token_ids``. Refused with a 400 naming the field: ``n``/``best_of`` other than 1,
    non-zero ``frequency_penalty``/``presence_penalty`` (the fleet has ``repetition_penalty``
    instead), ``logit_bias``, ``logprobs``/``top_logprobs``, ``echo``, ``suffix``, ``tools``,
    ``tool_choice`` other than "none", ``response_format`` other than text, embedding ``dimensions``,
    chat's ``store`` true, ``modalities`` other than text, ``reasoning_effort``, ``verbosity``,
    ``prediction``, ``audio``, ``web_search_options``, ``functions``, ``function_call`` other than "none",
    a message's ``tool_calls``/``function_call``/``audio``/``refusal`` unless null (the SDKs send them
    null when a returned message is sent back); each refusal says why (:data:`_WHY_REFUSED`).

Results
    ``finish_reason``: the fleet's ``stop`` → "stop", ``length`` → "length", ``deadline`` →
    "length" (a time budget ran out), ``cancelled`` → "stop" (only another caller's cancel shows
    here; the native ``GET /v1/requests/{id}`` keeps the exact reason). ``usage`` is the worker's.
"""

from __future__ import annotations

import base64
import re
import struct
from collections.abc import Sequence
from typing import Any, Literal, TypeVar

from pydantic import ValidationError

from gateway.errors import openai_error_of
from gateway.openai_schema import (
    ChatBody,
    ChatChoice,
    ChatCompletion,
    ChatMessage,
    ChatResponseMessage,
    CompletionBody,
    CompletionChoice,
    CompletionResponse,
    CompletionUsage,
    EmbeddingBody,
    EmbeddingData,
    EmbeddingList,
    EmbeddingUsage,
)
from protocol.errors import FleetError, InvalidRequest, ModelLoadError, error_from_payload
from protocol.messages import FinishReason, GenerationParams, InferenceResult, Usage, as_invalid_request
from protocol.streams import StreamEvent

__all__ = [
    "COMPLETIONS_DEFAULT_MAX_TOKENS",
    "DEFAULT_TEMPERATURE",
    "ChunkWriter",
    "Prompt",
    "chat_messages",
    "chat_response",
    "check_supported",
    "completion_prompt",
    "completion_response",
    "embedding_inputs",
    "embedding_list",
    "finish_reason",
    "generation_fallbacks",
    "generation_params",
    "input_field",
    "max_tokens_field",
    "prompt_field",
    "rename_field",
    "stream_error",
    "wrong_kind",
]

DEFAULT_TEMPERATURE = 1.0
"""OpenAI's default temperature."""
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for ``/v1/completions``."""

Prompt = tuple[list[int] | None, str | None]
"""One prompt: ``(token ids, None)`` or ``(None, text)``."""
Face = Literal["completion", "chat"]
E = TypeVar("E", bound=FleetError)


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
_NULL_ONLY = ("reasoning_effort", "verbosity", "prediction", "audio", "web_search_options")
"""Chat fields refused whenever they are sent with a value."""
"""Why each field :func:`check_supported` refuses cannot be honoured, as the 400 says it."""


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


def stream_error(event: StreamEvent) -> dict[str, Any]:
    """A stream's ``error`` event as OpenAI's error object (``message``, ``type``, ``param``, and ``code`` the
    fleet's error code, e.g. ``expired``; the event names the worker's error class)."""
    err = error_from_payload(event.error or "FleetError", [event.message or "", event.field, event.limit])
    error: dict[str, Any] = openai_error_of(err)["error"]
    return error


def wrong_kind(exc: E, model: str, task: str, instead: str) -> E | InvalidRequest:
    """``exc`` unless it says the model cannot produce what the route answers with (field ``output.kind``):
    then that, named ``model``: ``model`` cannot ``task`` (``generate text``), why, and ``instead`` (the
    route that serves such a model)."""
    if not isinstance(exc, InvalidRequest) or exc.field != "output.kind":
        return exc
    why = exc.message.split(": ", 1)[-1]
    return InvalidRequest(f"model {model!r} cannot {task}: {why}; {instead}", "model", exc.limit)


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
            parts (OpenAI refuses it for every role), or a tool call, function call,
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


def finish_reason(reason: FinishReason | None) -> str:
    """OpenAI's finish_reason for the fleet's (see the module docstring)."""
    return {"length": "length", "deadline": "length"}.get(reason or "stop", "stop")


def _usage(usage: Usage) -> CompletionUsage:
    return CompletionUsage(**usage.model_dump())


def _text(rid: str, model: str, result: InferenceResult) -> str:
    """The generated text; never an empty string standing in for text the worker could not write.

    Raises:
        ModelLoadError: (field ``tokenizer``) the worker returned token ids without text (the model has
            no tokenizer there); the ids are in the message and in ``GET /v1/requests/{rid}``.
    """
    gen = result.generation
    if gen is None:  # pragma: no cover - a generate request always has one
        raise ValueError(f"result {rid} holds no generation")
    if gen.text is None:
        raise ModelLoadError(
            f"model {model!r} generated token ids {gen.token_ids} but no text: it has no tokenizer on the worker "
            f"(GET /v1/requests/{rid} has the ids)",
            "tokenizer",
            None,
        )
    return gen.text


def completion_response(rid: str, model: str, created: int, result: InferenceResult) -> CompletionResponse:
    """A finished generation as a ``text_completion``.

    Raises:
        ModelLoadError: the generation has token ids but no text (see :func:`_text`).
    """
    text = _text(rid, model, result)
    gen = result.generation
    assert gen is not None  # _text checked it
    choice = CompletionChoice(text=text, finish_reason=finish_reason(gen.finish_reason))
    return CompletionResponse(id=f"cmpl-{rid}", created=created, model=model, choices=[choice], usage=_usage(gen.usage))


def chat_response(rid: str, model: str, created: int, result: InferenceResult) -> ChatCompletion:
    """A finished generation as a ``chat.completion``.

    Raises:
        ModelLoadError: the generation has token ids but no text (see :func:`_text`).
    """
    text = _text(rid, model, result)
    gen = result.generation
    assert gen is not None  # _text checked it
    choice = ChatChoice(message=ChatResponseMessage(content=text), finish_reason=finish_reason(gen.finish_reason))
    return ChatCompletion(id=f"chatcmpl-{rid}", created=created, model=model, choices=[choice], usage=_usage(gen.usage))


def embedding_list(model: str, results: Sequence[InferenceResult], encoding_format: str) -> EmbeddingList:
    """Vectors in input order; ``base64`` packs each as little-endian float32, as OpenAI does."""
    data = []
    for i, result in enumerate(results):
        vector = result.embedding or []
        packed = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        data.append(EmbeddingData(index=i, embedding=packed if encoding_format == "base64" else vector))
    tokens = sum(r.input_tokens for r in results)
    return EmbeddingList(data=data, model=model, usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))


class ChunkWriter:
    """Stream events of one generation → OpenAI chunk payloads (``data:`` frames without the framing).

    Chat streams open with a ``{"role": "assistant"}`` delta; each token with text adds a delta; the
    final event gives a chunk with ``finish_reason`` (and its held-back text), then — with
    ``include_usage`` — a chunk with ``usage`` and no choices (every chunk before it has ``"usage": null``,
    as OpenAI's do). With ``continuous_usage`` (vLLM's
    ``continuous_usage_stats``) every chunk carries ``usage`` so far: ``prompt_tokens`` (the request's
    ``prompt_tokens`` input ids), the tokens generated up to that chunk, and their sum; the final
    chunk's is the worker's. An error event gives OpenAI's error object, which the SDKs raise as
    ``APIError``.
    """

    def __init__(
        self, face: Face, rid: str, model: str, created: int, *, include_usage: bool = False,
        continuous_usage: bool = False, prompt_tokens: int = 0,
    ) -> None:  # fmt: skip
        self.face = face
        self.model = model
        self.created = created
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.id = f"chatcmpl-{rid}" if face == "chat" else f"cmpl-{rid}"
        self.object = "chat.completion.chunk" if face == "chat" else "text_completion"

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        head = {"id": self.id, "object": self.object, "created": self.created, "model": self.model}
        if self.continuous_usage and "usage" not in extra:
            done = self.completion_tokens
            extra["usage"] = {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
                              "total_tokens": self.prompt_tokens + done}  # fmt: skip
        elif self.include_usage and "usage" not in extra:  # as OpenAI: every chunk names usage, null until the last
            extra["usage"] = None
        return {**head, "choices": choices, **extra}

    def _choice(self, text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
        if self.face == "completion":
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text:
            delta["content"] = text
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    def opening(self) -> list[dict[str, Any]]:
        """What a stream starts with before any token (chat: the role)."""
        return [self._chunk([self._choice(None, None, role=True)])] if self.face == "chat" else []

    def on_event(self, event: StreamEvent) -> list[dict[str, Any]]:
        """The payloads one event gives (none for a token that adds no text yet)."""
        if event.type == "token":
            self.completion_tokens = max(self.completion_tokens, event.index + 1)  # index: 0-based token number
            return [self._chunk([self._choice(event.text, None)])] if event.text else []
        if event.type == "error":
            return [{"error": stream_error(event)}]
        if event.usage is not None:  # the worker's own count ends the stream
            self.prompt_tokens, self.completion_tokens = event.usage.prompt_tokens, event.usage.completion_tokens
        out = [self._chunk([self._choice(event.text, finish_reason(event.finish_reason))])]
        if self.include_usage and event.usage is not None:
            out.append(self._chunk([], usage=_usage(event.usage).model_dump()))
        return out
