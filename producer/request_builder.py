"""Building a request as a worker would check it: caller arguments turned into one :class:`InferenceRequest`.

:class:`RequestBuilder` is the part of :class:`producer.client.FleetClient` that validates and tokenizes a
request without queueing anything (``FleetClient.build_request``; the gateway's faces build theirs with it
too). Every check a worker makes is made here first, so bad input is refused as
:class:`~protocol.errors.InvalidRequest` naming the field and the limit before anything is queued.
"""

from __future__ import annotations

import numbers
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from producer.arguments import checked_str, integer, plain_numbers, token_ids
from producer.generation_defaults import generation_fields
from producer.model_cards import ModelCards
from protocol.errors import InvalidRequest
from protocol.keys import REQUEST_ID_PATTERN, REQUEST_ID_RULE
from protocol.messages import GenerationParams, InferenceRequest, OutputSpec, as_invalid_request
from protocol.validation import check_generation_room, check_input, resolve_output

__all__ = ["DEFAULT_TOP_K", "MAX_DEADLINE_S", "RequestBuilder"]


DEFAULT_TOP_K = 5
"""Next-token candidates returned when a ``next_token`` request does not say how many."""

MAX_DEADLINE_S = 86_400.0
"""Longest ``deadline_s`` a request may carry (s), on every face."""


def _output_spec(
    *, kind: str | None, top_k: int, normalize: bool, generation: GenerationParams | Mapping[str, Any] | None
) -> OutputSpec:
    """The request's output spec from client arguments; bad values become InvalidRequest."""
    try:
        params = GenerationParams.model_validate(generation) if generation is not None else None
    except ValidationError as exc:
        raise as_invalid_request(exc, prefix="output.generation") from exc
    try:
        return OutputSpec(kind=kind, top_k=top_k, normalize=normalize, generation=params)  # type: ignore[arg-type]
    except ValidationError as exc:
        raise as_invalid_request(exc, prefix="output") from exc


def _typed_arguments(
    model: Any, text: Any, request_id: Any, top_k: Any, deadline_s: Any, generation: Any
) -> tuple[int | None, GenerationParams | Mapping[str, Any] | None]:
    """``build_request``'s arguments of the wrong type refused as InvalidRequest naming them; returns ``top_k``
    and ``generation`` with numpy numbers made Python's.

    Raises:
        InvalidRequest: ``model``, ``text`` or ``request_id`` not a string, ``top_k`` not an integer,
            ``deadline_s`` not a number, ``generation`` neither a GenerationParams nor a dict.
    """
    checked_str(model, "model", optional=False)
    checked_str(text, "text")
    checked_str(request_id, "request_id")
    if deadline_s is not None and (isinstance(deadline_s, bool) or not isinstance(deadline_s, numbers.Real)):
        raise InvalidRequest(f"deadline_s must be a number of seconds, not {type(deadline_s).__name__} "
                             f"{deadline_s!r}"[:120], "deadline_s", MAX_DEADLINE_S)  # fmt: skip
    if isinstance(generation, Mapping):
        generation = plain_numbers(generation)  # numpy numbers (max_new_tokens, stop_token_ids) as Python's
    elif generation is not None and not isinstance(generation, GenerationParams):
        raise InvalidRequest(f"output.generation must be a GenerationParams or a dict of its fields, not "
                             f"{type(generation).__name__}", "output.generation", None)  # fmt: skip
    return (None if top_k is None else integer(top_k, "output.top_k")), generation


def _as_text_error(exc: InvalidRequest) -> InvalidRequest:
    """An error about the ids tokenized from a request's text, named ``text`` as the caller sent it."""
    if exc.field != "input_ids":
        return exc
    return type(exc)(exc.message.replace("input_ids", "text", 1), "text", exc.limit)


class RequestBuilder(ModelCards):
    """Requests validated and tokenized with each model's card and tokenizer, ready to queue."""

    def build_request(
        self,
        model: str,
        input_ids: Sequence[int] | None = None,
        *,
        text: str | None = None,
        request_id: str | None = None,
        top_k: int | None = None,
        normalize: bool = True,
        kind: str | None = None,
        deadline_s: float | None = None,
        generation: GenerationParams | Mapping[str, Any] | None = None,
        generation_fallbacks: Mapping[str, Any] | None = None,
    ) -> InferenceRequest:
        """Validate and tokenize one request exactly as a worker would, without queueing it.

        ``generation`` (a :class:`GenerationParams` or its fields as a dict) makes it a ``generate`` job.
        Its fields left unset take the model's ``generation_config.json`` defaults, else
        ``generation_fallbacks`` (a face's own defaults, e.g. OpenAI's temperature 1), else the
        fleet's (:mod:`producer.generation_defaults`). ``top_k`` (next-token candidates, default 5) is
        only for ``next_token`` output: given with any other, it is refused, not ignored.

        ``input_ids`` may hold any integral numbers (numpy's too: they are sent as ``int``); text goes in
        ``text``, never as bytes or a str in ``input_ids``.

        Raises:
            InvalidRequest: (or a subclass) naming the field and the limit; never a pydantic error, nor a
                TypeError for an argument of the wrong type.
        """
        if (input_ids is None) == (text is None):
            raise InvalidRequest("give exactly one of input_ids or text", "input_ids", None)
        top_k, generation = _typed_arguments(model, text, request_id, top_k, deadline_s, generation)
        if request_id is not None and not request_id:
            raise InvalidRequest("request_id is empty: give an ID, or none to get a fresh one", "request_id", None)
        if request_id is not None and not re.fullmatch(REQUEST_ID_PATTERN, request_id):  # as the gateway's
            raise InvalidRequest(f"request_id {request_id[:40]!r}{'…' if len(request_id) > 40 else ''} must be "
                                 f"{REQUEST_ID_RULE}: the ID names Redis keys and the URL GET /v1/requests/{{id}}",
                                 "request_id", REQUEST_ID_PATTERN)  # fmt: skip
        if deadline_s is not None and not 0 < deadline_s <= MAX_DEADLINE_S:  # as POST /v1/requests refuses it
            raise InvalidRequest(f"deadline_s = {deadline_s} must be > 0 and <= {MAX_DEADLINE_S:g} s (a request "
                                 "already past its deadline is never run)", "deadline_s", MAX_DEADLINE_S)  # fmt: skip
        key, info = self._model(model)
        ids = token_ids(input_ids) if input_ids is not None else self.tokenize(key, text or "")
        limits = self.settings.models[key].limits
        if generation is not None or kind == "generate":
            generation = generation_fields(generation, model=self.settings.models[key], card=info.card,
                                           prompt_tokens=len(ids), fallbacks=generation_fallbacks)
        spec = _output_spec(kind=kind, top_k=DEFAULT_TOP_K if top_k is None else top_k, normalize=normalize,
                            generation=generation)  # fmt: skip
        truncated = False
        if info.card is not None:
            try:
                checked = check_input(ids, limits=limits, vocab_size=info.card.vocab_size,
                                      max_positions=info.card.max_positions)  # fmt: skip
            except InvalidRequest as exc:  # the caller sent text: its tokens are too many, or none
                raise _as_text_error(exc) if text is not None else exc from exc
            ids, truncated = checked.input_ids, checked.truncated
            spec = resolve_output(spec, model_kind=info.card.kind, limits=limits, vocab_size=info.card.vocab_size)
            if spec.kind == "generate" and spec.generation is not None:  # as the worker checks it: refused here
                check_generation_room(len(ids), spec.generation.max_new_tokens, max_positions=info.card.max_positions,
                                      max_kv_tokens=self.settings.models[key].batching.max_kv_tokens)  # fmt: skip
            if top_k is not None and spec.kind != "next_token":
                raise InvalidRequest(f"output.top_k is the count of next-token candidates returned; this request's "
                                     f"output is {spec.kind!r} (model {model!r}), which has none: leave top_k out",
                                     "output.top_k", None)  # fmt: skip
        now = time.time()
        try:
            return InferenceRequest(
                model=key,
                input_ids=ids,
                output=spec,
                request_id=request_id or uuid.uuid4().hex,
                truncated=truncated,
                submitted_at_unix_s=now,
                deadline_unix_s=now + deadline_s if deadline_s is not None else None,
            )
        except ValidationError as exc:
            raise as_invalid_request(exc) from exc
