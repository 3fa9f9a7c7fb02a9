"""FleetClient: submit tokenized requests, get a request ID back at once, poll results by ID.

::

    client = FleetClient.from_settings()                # FLEET_* env + configs/fleet.yaml
    rid = client.submit("demo-lm", text="Hello")        # validated and tokenized here
    result = client.result(rid, wait=True, timeout_s=10)

Text is tokenized by the producer: what travels through Redis is always token ids. Every check
a worker makes is made here first, so bad input is refused before anything is queued.
"""

from __future__ import annotations

import json
import numbers
import re
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from celery import Celery
from pydantic import ValidationError

from broker import make_celery
from producer import bulk_submit
from producer.admission import Admission
from producer.arguments import checked_str, integer, plain_numbers, token_ids
from producer.generation_defaults import generation_fields
from producer.idempotent_queue import (
    IdempotentQueue,
    conflict,
    quiet_backend,
    request_fingerprint,
)
from producer.reprs import request_argsrepr
from producer.result_waiter import ResultWaiter
from producer.results import RequestStatus, ResultReader
from producer.routing import Router
from producer.submit_groups import generates
from producer.task_writer import TaskMessage, TaskWriter
from protocol.celeryconf import celery_config
from protocol.errors import (
    InputTooLong,
    InvalidRequest,
    QueueFull,
    RateLimited,
)
from protocol.keys import CARD_KEY, REQUEST_ID_PATTERN, REQUEST_ID_RULE, REQUEST_KEY
from protocol.messages import (
    TASK_NAME,
    GenerationParams,
    InferenceRequest,
    OutputSpec,
    as_invalid_request,
)
from protocol.model_state import Role
from protocol.modelcard import ModelCard, load_card
from protocol.redis_conn import sync_client
from protocol.settings import FleetSettings, load_settings
from protocol.tokenization import Tokenizer, load_tokenizer
from protocol.validation import check_generation_room, check_input, resolve_output

__all__ = ["CARD_MISS_TTL_S", "MAX_DEADLINE_S", "FleetClient", "RequestStatus", "request_fingerprint"]


DEFAULT_TOP_K = 5
"""Next-token candidates returned when a ``next_token`` request does not say how many."""
SPECIAL_TOKENS_ROOM = 8
"""Tokens allowed for what a tokenizer adds (BOS, ``[CLS]``/``[SEP]``) when bounding a text by its length."""
NORMALIZATION_ROOM = 2
"""How many times longer a text may be than its tokens could cover, for normalizers that shrink it
(accents stripped, NFKC, control characters removed) before it is tokenized."""


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


MAX_DEADLINE_S = 86_400.0
"""Longest ``deadline_s`` a request may carry (s), on every face."""


CARD_MISS_TTL_S = 5.0
"""How long a client goes on without a model's card it found neither in the model's file nor in Redis before it
reads Redis again (s): a service started before the model's workers learns the card they publish this much
later at most, and meanwhile costs no Redis read per request. A card that was found is kept."""


class _ModelInfo:
    def __init__(self, card: ModelCard | None, tokenizer: Tokenizer | None, read_s: float) -> None:
        self.card = card
        self.tokenizer = tokenizer
        self.read_s = read_s
        """When the card was looked for (``time.monotonic()`` s)."""

    def fresh(self, now_s: float) -> bool:
        """Whether to use this as it is: a card was found, or the miss is younger than :data:`CARD_MISS_TTL_S`."""
        return self.card is not None or now_s - self.read_s < CARD_MISS_TTL_S


class FleetClient(ResultReader):
    """Producer-side API over Celery + Redis. Thread-safe for concurrent submits.

    Submitting lives here; reading back (status, results, waits, streams, cancels) in
    :class:`producer.results.ResultReader`.
    """

    def __init__(self, settings: FleetSettings, celery_app: Celery | None = None) -> None:
        self.settings = settings
        self.app = celery_app or make_celery(celery_config(settings), "onnx-fleet-producer")
        self.redis = sync_client(settings)
        self.admission = Admission(self.redis, settings)
        self.router = Router(self.redis, settings)
        self.writer = TaskWriter(self.app, self.redis)
        self.queuer = IdempotentQueue(self.redis, self.app, self.writer, settings.result_ttl_s)
        self.waiter = ResultWaiter(self.redis, lambda raw: dict(self.app.backend.decode_result(raw)))
        self._models: dict[str, _ModelInfo] = {}
        self.monotonic: Callable[[], float] = time.monotonic
        """The clock that ages a missing card (s); tests replace it."""

    @classmethod
    def from_settings(cls, config_path: str | Path | None = None, **overrides: Any) -> FleetClient:
        """A client from ``FLEET_*`` env and the YAML config, ``overrides`` (top-level settings) beating both
        (see :func:`protocol.settings.load_settings`).

        Raises:
            ConfigError: a setting, or an override, broke a rule.
        """
        return cls(load_settings(config_path, **overrides))

    def close(self) -> None:
        """Release connections, the result backend's pub/sub connection included."""
        consumer = getattr(self.app.backend, "result_consumer", None)
        if consumer is not None:
            consumer.stop()
        self.waiter.close()
        self.redis.close()
        self.app.close()

    # -- model knowledge -------------------------------------------------------------------------
    def _model(self, model: str) -> tuple[str, _ModelInfo]:
        """``model``'s key and what this client knows of it: the card and tokenizer of its file, else the card its
        workers published in Redis; a miss is looked for again after :data:`CARD_MISS_TTL_S`."""
        key = self.settings.model_key(model)
        info = self._models.get(key)
        now_s = self.monotonic()
        if info is None or not info.fresh(now_s):
            card: ModelCard | None = None
            tokenizer: Tokenizer | None = None
            path = self.settings.models[key].path
            if path.exists():
                card = load_card(path)
                tokenizer = load_tokenizer(card, path.parent)
            else:
                raw = self.redis.get(CARD_KEY.format(model=key))
                if raw:
                    card = ModelCard.model_validate_json(raw)
                    if card.tokenizer == "byte":
                        tokenizer = load_tokenizer(card, path.parent)
            info = self._models[key] = _ModelInfo(card, tokenizer, now_s)
        return key, info

    def model_loaded(self, model: str) -> bool:
        """True when ``model``'s card and tokenizer are already in memory (building a request for it then
        reads no file and no Redis key: safe on an event loop).

        Raises:
            UnknownModel: ``model`` is not configured.
        """
        info = self._models.get(self.settings.model_key(model))
        return info is not None and info.fresh(self.monotonic())

    def model_card(self, model: str) -> ModelCard | None:
        """``model``'s card as this client knows it (its file's, else the one its workers published in
        Redis); None when neither is available here (Redis is read again :data:`CARD_MISS_TTL_S` later)."""
        return self._model(model)[1].card

    def tokenize(self, model: str, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` with the model's own tokenizer; ``add_special_tokens=False`` for text
        that already holds them (a rendered chat template: see :meth:`Tokenizer.encode`).

        Raises:
            InvalidRequest: the model's tokenizer is not available on this machine.
        """
        _, info = self._model(model)
        if info.tokenizer is None:
            why = (
                "has no tokenizer (its card says tokenizer 'none')"
                if info.card is not None and info.card.tokenizer == "none"
                else "has no tokenizer on this machine"
            )
            raise InvalidRequest(f"model {model!r} {why}: send input_ids", "text", None)
        text = self._tokenized_part(self.settings.model_key(model), info.tokenizer, text)
        return info.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _tokenized_part(self, key: str, tokenizer: Tokenizer, text: str) -> str:
        """The part of ``text`` worth tokenizing: all of it, unless it is longer than any text that
        fits ``limits.max_input_tokens`` could be. Tokenizing costs memory per token (~100 bytes each
        in Hugging Face tokenizers: 16 texts of 1 MiB took a gateway to 1.8 GB), so such a text is
        refused before it is tokenized (``truncate: none``), or cut to the end that truncation keeps
        (``left``: its end, ``right``: its start) with room to spare, which leaves the kept tokens as
        they were.

        Raises:
            InputTooLong: ``truncate`` is ``none`` and ``text`` must have more tokens than the limit.
        """
        per_token = getattr(tokenizer, "max_token_chars", None)
        if not isinstance(per_token, int) or per_token < 1:  # a tokenizer that cannot say: tokenize it all
            return text
        limits = self.settings.models[key].limits
        window = (limits.max_input_tokens + SPECIAL_TOKENS_ROOM) * per_token * NORMALIZATION_ROOM
        if len(text) <= window:
            return text
        if limits.truncate == "none":
            cap = limits.max_input_tokens
            raise InputTooLong(
                f"text has {len(text)} characters, more than {cap} tokens of this tokenizer can hold (a token "
                f"covers at most {per_token} characters); the limit is max_input_tokens={cap}",
                "text",
                cap,
            )
        return text[-window:] if limits.truncate == "left" else text[:window]

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
                checked = check_input(ids, limits=limits, vocab_size=info.card.vocab_size)
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

    # -- submit -----------------------------------------------------------------------------------
    def submit(
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
        rate_key: str | None = None,
        routing_key: str | None = None,
    ) -> str:
        """Queue one request; returns its ID at once.

        A caller-given ``request_id`` makes the submit idempotent: an ID already known is not
        queued twice. ``deadline_s`` (seconds from now): past it the request is never computed.
        ``generation`` makes it a ``generate`` job (:meth:`stream` then yields its tokens).
        ``rate_key`` draws on that caller's rate-limit bucket (``admission.rate_capacity``), as the
        gateway does per API key; None = no rate limit (the queue-depth cap always applies).
        ``routing_key`` (default: the request ID) decides, sticky, whether a model with a canary
        serves it from the canary (:mod:`producer.routing`).

        Raises:
            InvalidRequest: bad input (nothing is queued).
            QueueFull / RateLimited: refused by admission control (nothing is queued).
        """
        request = self.build_request(
            model,
            input_ids,
            text=text,
            request_id=request_id,
            top_k=top_k,
            normalize=normalize,
            kind=kind,
            deadline_s=deadline_s,
            generation=generation,
        )
        return self.send(request, rate_key=rate_key, text=text, routing_key=routing_key)

    def send(
        self,
        request: InferenceRequest,
        *,
        rate_key: str | None = None,
        admit: bool = True,
        text: str | None = None,
        routing_key: str | None = None,
        role: Role | None = None,
    ) -> str:
        """Queue an already built request; returns its ID.

        Admission control runs first (unless ``admit`` is False: the caller already admitted it),
        except for an ID already known, which is never queued twice. ``rate_key`` names the
        caller's rate-limit bucket (None = no rate limit; see :mod:`producer.admission`). ``text``
        (what the ids were tokenized from) is shown beside them in Flower, never sent to the worker.
        The queue is the model's stable or canary queue, chosen by ``routing_key`` (default: the
        request ID), or the one of ``role`` when given (``fleet models compare``'s shadow sample).

        Raises:
            QueueFull: the model's queue is at ``max_queue_depth``; nothing was queued.
            RateLimited: ``rate_key``'s token bucket is empty; nothing was queued.
            IdempotencyConflict: the ID is known with another body; nothing was queued.
        """
        if request.request_id is None:
            request = request.model_copy(update={"request_id": uuid.uuid4().hex})
        rid = str(request.request_id)
        fingerprint = request_fingerprint(request)
        rate_limited = rate_key is not None and self.settings.admission.rate_capacity > 0
        if rate_limited or not admit:  # a known ID must not spend rate tokens: look it up first
            known = self.redis.get(REQUEST_KEY.format(id=rid))
            if known is not None:
                return self._resubmitted(rid, known, fingerprint)
        if admit:
            try:  # usually no Redis command at all (producer.admission.DepthCache)
                self.admission.admit(request.model, rate_key=rate_key)
            except (QueueFull, RateLimited):
                known = self.redis.get(REQUEST_KEY.format(id=rid))  # a known ID answers with its ID, even at the cap
                if known is None:
                    raise
                return self._resubmitted(rid, known, fingerprint)
        model = request.model
        queue = (
            self.router.queue(model, role)
            if role
            else self.router.choose(model, routing_key or rid, _generation_prompt(request))
        )
        new = self._queue_tasks([request], [queue], [request_argsrepr(request, text)])
        if new[0] and role is None:  # not a shadow request itself
            self.router.sample_prompt(request.model, rid, request.input_ids)
        return rid

    def send_batch(
        self,
        requests: Sequence[InferenceRequest],
        *,
        routing_keys: Sequence[str | None] | None = None,
        label: str = "requests",
    ) -> list[str]:
        """Queue already built and admitted requests all or none, in one Redis step; returns their IDs.

        Every ID is checked before anything is queued, duplicates inside the batch included: an ID
        known (or repeated) with the same body is that request and is not queued again; with another
        body nothing at all is queued. ``routing_keys[i]`` (default: the request ID) picks request
        i's stable or canary queue. Admission is the caller's (the gateway admits the whole batch).

        Raises:
            IdempotencyConflict: naming ``{label}[i].request_id``; nothing was queued.
        """
        keys = list(routing_keys) if routing_keys is not None else [None] * len(requests)
        if len(keys) != len(requests):
            raise InvalidRequest(f"routing_keys has {len(keys)} keys for {len(requests)} requests", "routing_keys",
                                 len(requests))  # fmt: skip
        requests = [r if r.request_id else r.model_copy(update={"request_id": uuid.uuid4().hex}) for r in requests]
        queues = self.router.choose_many(
            [(r.model, key or str(r.request_id), _generation_prompt(r)) for r, key in zip(requests, keys, strict=True)]
        )
        new = self._queue_tasks(requests, queues, [request_argsrepr(r, None) for r in requests],
                                label=lambda i: f"{label}[{i}]")  # fmt: skip
        for r, fresh in zip(requests, new, strict=True):
            if fresh:
                self.router.sample_prompt(r.model, str(r.request_id), r.input_ids)
        return [str(r.request_id) for r in requests]

    def _queue_tasks(
        self,
        requests: Sequence[InferenceRequest],
        queues: Sequence[str],
        argsreprs: Sequence[str],
        *,
        label: Callable[[int], str] = lambda _: "",
    ) -> list[bool]:
        """One ``fleet.infer`` task per new request, claimed and queued atomically; True where queued."""

        def args_of(i: int) -> list[Any]:
            return [requests[i].model_dump(mode="json", exclude_none=True)]

        def build(new: list[int]) -> list[TaskMessage]:  # one script: SET NX markers + LPUSH + task-sent events
            return [self.writer.build(TASK_NAME, str(requests[i].request_id), queues[i], args_of(i),
                                      argsrepr=argsreprs[i], kwargsrepr="{}") for i in new]  # fmt: skip

        def send(new: list[int], sent: list[int]) -> None:
            quiet_backend(self.app)
            for i in new:
                self.app.send_task(TASK_NAME, args=args_of(i), task_id=str(requests[i].request_id), queue=queues[i],
                                   argsrepr=argsreprs[i], kwargsrepr="{}")  # fmt: skip
                sent.append(i)

        return self.queuer.queue(requests, build, send, label=label)

    @staticmethod
    def _resubmitted(request_id: str, marker: bytes | None, fingerprint: str) -> str:
        """A known ID: the same body is the same request (returns its ID); another body is refused."""
        try:
            known = json.loads(marker).get("fingerprint") if marker else None
        except (ValueError, AttributeError):
            known = None
        if known is not None and known != fingerprint:
            raise conflict(request_id)
        return request_id

    def submit_many(
        self,
        model: str,
        inputs: Iterable[Sequence[int] | str],
        *,
        progress: bool = True,
        threads: int = 1,
        **options: Any,
    ) -> list[str]:
        """Submit many requests (token-id lists or texts) in order, one ``fleet.infer`` task each; returns
        their IDs. See :func:`producer.bulk_submit.submit_many` (``threads``, ``progress``, what is raised)."""
        return bulk_submit.submit_many(self, model, inputs, progress=progress, threads=threads, **options)

    def submit_bulk(
        self,
        model: str,
        inputs: Iterable[Sequence[int] | str],
        *,
        chunk_size: int = 512,
        progress: bool = False,
        rate_key: str | None = None,
        routing_keys: Sequence[str] | None = None,
        **options: Any,
    ) -> list[str]:
        """Queue many requests as ``fleet.infer_bulk`` messages of ``chunk_size`` requests each; returns
        their IDs. See :func:`producer.bulk_submit.submit_bulk` (idempotency, canary split, what is raised)."""
        return bulk_submit.submit_bulk(self, model, inputs, chunk_size=chunk_size, progress=progress,
                                       rate_key=rate_key, routing_keys=routing_keys, **options)  # fmt: skip


def _generation_prompt(request: InferenceRequest) -> list[int] | None:
    """The prompt of a generation (what prefix-aware routing looks at); None for any other request."""
    return list(request.input_ids) if generates(request) and request.input_ids else None
