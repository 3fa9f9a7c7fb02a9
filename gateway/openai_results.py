"""The fleet's results and stream events in OpenAI's shapes (pure: no I/O): ``text_completion``,
``chat.completion``, the embeddings list (float or base64 float32 vectors), stream chunks
(:class:`ChunkWriter`) and a stream's error object. Finish reasons: :mod:`gateway.openai_mapping`.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Sequence
from typing import Any

from gateway.errors import openai_error_of
from gateway.openai_params import Face
from gateway.openai_schema import (
    ChatChoice,
    ChatCompletion,
    ChatResponseMessage,
    CompletionChoice,
    CompletionResponse,
    CompletionUsage,
    EmbeddingData,
    EmbeddingList,
    EmbeddingUsage,
    PromptTokensDetails,
)
from protocol.errors import ModelLoadError, error_from_payload
from protocol.messages import FinishReason, InferenceResult, Usage
from protocol.streams import StreamEvent

__all__ = ["ChunkWriter", "chat_response", "completion_response", "embedding_list", "finish_reason", "stream_error"]


def finish_reason(reason: FinishReason | None) -> str:
    """OpenAI's finish_reason for the fleet's (see :mod:`gateway.openai_mapping`)."""
    return {"length": "length", "deadline": "length"}.get(reason or "stop", "stop")


def _usage(usage: Usage) -> CompletionUsage:
    """The fleet's usage in OpenAI's shape: the prefix-cache tokens as ``prompt_tokens_details.cached_tokens``."""
    return CompletionUsage(
        prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens, total_tokens=usage.total_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens),
    )


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


def _finished(rid: str, model: str, result: InferenceResult) -> tuple[str, str, CompletionUsage]:
    """A finished generation's text, OpenAI finish_reason and usage: what both response shapes carry.

    Raises:
        ModelLoadError: the generation has token ids but no text (see :func:`_text`).
    """
    text = _text(rid, model, result)
    gen = result.generation
    assert gen is not None  # _text checked it
    return text, finish_reason(gen.finish_reason), _usage(gen.usage)


def completion_response(rid: str, model: str, created: int, result: InferenceResult) -> CompletionResponse:
    """A finished generation as a ``text_completion``.

    Raises:
        ModelLoadError: the generation has token ids but no text (see :func:`_text`).
    """
    text, finish, usage = _finished(rid, model, result)
    choice = CompletionChoice(text=text, finish_reason=finish)
    return CompletionResponse(id=f"cmpl-{rid}", created=created, model=model, choices=[choice], usage=usage)


def chat_response(rid: str, model: str, created: int, result: InferenceResult) -> ChatCompletion:
    """A finished generation as a ``chat.completion``.

    Raises:
        ModelLoadError: the generation has token ids but no text (see :func:`_text`).
    """
    text, finish, usage = _finished(rid, model, result)
    choice = ChatChoice(message=ChatResponseMessage(content=text), finish_reason=finish)
    return ChatCompletion(id=f"chatcmpl-{rid}", created=created, model=model, choices=[choice], usage=usage)


def embedding_list(model: str, results: Sequence[InferenceResult], encoding_format: str) -> EmbeddingList:
    """Vectors in input order; ``base64`` packs each as little-endian float32, as OpenAI does."""
    data = []
    for i, result in enumerate(results):
        vector = result.embedding or []
        packed = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        data.append(EmbeddingData(index=i, embedding=packed if encoding_format == "base64" else vector))
    tokens = sum(r.input_tokens for r in results)
    return EmbeddingList(data=data, model=model, usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))


def stream_error(event: StreamEvent) -> dict[str, Any]:
    """A stream's ``error`` event as OpenAI's error object (``message``, ``type``, ``param``, and ``code`` the
    fleet's error code, e.g. ``expired``; the event names the worker's error class)."""
    err = error_from_payload(event.error or "FleetError", [event.message or "", event.field, event.limit])
    error: dict[str, Any] = openai_error_of(err)["error"]
    return error


class ChunkWriter:
    """Stream events of one generation → OpenAI chunk payloads (``data:`` frames without the framing).

    Chat streams open with a ``{"role": "assistant"}`` delta; each token with text adds a delta; the
    final event gives a chunk with ``finish_reason`` (and its held-back text), then — with
    ``include_usage`` — a chunk with ``usage`` and no choices (every chunk before it has ``"usage": null``,
    as OpenAI's do). With ``continuous_usage`` (vLLM's
    ``continuous_usage_stats``) every chunk carries ``usage`` so far: ``prompt_tokens`` (the request's
    ``prompt_tokens`` input ids), the tokens generated up to that chunk, and their sum; the final
    chunk's is the worker's (with ``prompt_tokens_details.cached_tokens``). An error event gives OpenAI's
    error object, which the SDKs raise as ``APIError``.
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
        self.cached_tokens: int | None = None
        """Prompt tokens from the prefix cache, once the worker's final count says (continuous usage)."""
        self.id = f"chatcmpl-{rid}" if face == "chat" else f"cmpl-{rid}"
        self.object = "chat.completion.chunk" if face == "chat" else "text_completion"

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        head = {"id": self.id, "object": self.object, "created": self.created, "model": self.model}
        if self.continuous_usage and "usage" not in extra:
            done = self.completion_tokens
            extra["usage"] = {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
                              "total_tokens": self.prompt_tokens + done}  # fmt: skip
            if self.cached_tokens is not None:  # known from the worker's final count
                extra["usage"]["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
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
            self.cached_tokens = event.usage.cached_tokens
        out = [self._chunk([self._choice(event.text, finish_reason(event.finish_reason))])]
        if self.include_usage and event.usage is not None:
            out.append(self._chunk([], usage=_usage(event.usage).model_dump()))
        return out
