"""FleetClient: submit tokenized requests, get a request ID back at once, poll results by ID.

::

    client = FleetClient.from_settings()                # FLEET_* env + configs/fleet.yaml
    rid = client.submit("demo-lm", text="Hello")        # validated and tokenized here
    result = client.result(rid, wait=True, timeout_s=10)

Text is tokenized by the producer: what travels through Redis is always token ids. Every check
a worker makes is made here first, so bad input is refused before anything is queued.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from celery import Celery
from pydantic import ValidationError

from producer.admission import Admission
from producer.generation_defaults import generation_fields
from producer.reprs import request_argsrepr
from producer.result_waiter import ResultWaiter
from producer.results import RequestStatus, ResultReader
from producer.routing import Router
from producer.task_writer import TaskWriter
from protocol.celeryconf import make_celery
from protocol.errors import (
    IdempotencyConflict,
    InvalidRequest,
    QueueFull,
    RateLimited,
)
from protocol.keys import CARD_KEY, REQUEST_KEY
from protocol.messages import (
    BULK_TASK_NAME,
    MAX_BULK_REQUESTS,
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
from protocol.validation import check_input, resolve_output

__all__ = ["FleetClient", "RequestStatus"]


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


def request_fingerprint(request: InferenceRequest) -> str:
    """sha256 of what makes a request the same request (model, ids, output); not its ID or timestamps."""
    body = request.model_dump(mode="json", include={"model", "input_ids", "output", "truncated"})
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class _ModelInfo:
    def __init__(self, card: ModelCard | None, tokenizer: Tokenizer | None) -> None:
        self.card = card
        self.tokenizer = tokenizer


def _no_send_time_subscription(producer: Any, task_id: str) -> None:
    """Replaces the result backend's ``on_task_call``: subscribe on wait only (see :func:`_quiet_backend`)."""


def _quiet_backend(app: Celery) -> None:
    """Stop this thread's result backend from subscribing to a task's result channel as it is sent.

    Celery subscribes on send, and the AsyncResult that ``send_task`` returns (dropped by the fleet)
    unsubscribes at once: 2 wasted Redis commands per request. ``ResultReader.result`` subscribes when
    it waits, then reads the stored result once, so a result published in between is not missed.
    Celery keeps one Redis result backend per thread (it is not ``thread_safe``), hence per call.
    """
    backend = app.backend
    if vars(backend).get("on_task_call") is not _no_send_time_subscription:
        backend.on_task_call = _no_send_time_subscription


class FleetClient(ResultReader):
    """Producer-side API over Celery + Redis. Thread-safe for concurrent submits.

    Submitting lives here; reading back (status, results, waits, streams, cancels) in
    :class:`producer.results.ResultReader`.
    """

    def __init__(self, settings: FleetSettings, celery_app: Celery | None = None) -> None:
        self.settings = settings
        self.app = celery_app or make_celery(settings, "onnx-fleet-producer")
        self.redis = sync_client(settings)
        self.admission = Admission(self.redis, settings)
        self.router = Router(self.redis, settings)
        self.writer = TaskWriter(self.app, self.redis)
        self.waiter = ResultWaiter(self.redis, lambda raw: dict(self.app.backend.decode_result(raw)))
        self._models: dict[str, _ModelInfo] = {}

    @classmethod
    def from_settings(cls, config_path: str | Path | None = None, **overrides: Any) -> FleetClient:
        """A client from ``FLEET_*`` env and the YAML config (see :func:`protocol.settings.load_settings`)."""
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
        key = self.settings.model_key(model)
        if key not in self._models:
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
            self._models[key] = _ModelInfo(card, tokenizer)
        return key, self._models[key]

    def model_card(self, model: str) -> ModelCard | None:
        """``model``'s card as this client knows it (its file's, else the one its workers published in
        Redis); None when neither is available here."""
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
        return info.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def build_request(
        self,
        model: str,
        input_ids: Sequence[int] | None = None,
        *,
        text: str | None = None,
        request_id: str | None = None,
        top_k: int = 5,
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
        fleet's (:mod:`producer.generation_defaults`).

        Raises:
            InvalidRequest: (or a subclass) naming the field and the limit; never a pydantic error.
        """
        if (input_ids is None) == (text is None):
            raise InvalidRequest("give exactly one of input_ids or text", "input_ids", None)
        key, info = self._model(model)
        ids = list(input_ids) if input_ids is not None else self.tokenize(key, text or "")
        limits = self.settings.models[key].limits
        if generation is not None or kind == "generate":
            generation = generation_fields(generation, model_path=self.settings.models[key].path, card=info.card,
                                           limits=limits, prompt_tokens=len(ids), fallbacks=generation_fallbacks)
        spec = _output_spec(kind=kind, top_k=top_k, normalize=normalize, generation=generation)
        truncated = False
        if info.card is not None:
            checked = check_input(ids, limits=limits, vocab_size=info.card.vocab_size)
            ids, truncated = checked.input_ids, checked.truncated
            spec = resolve_output(spec, model_kind=info.card.kind, limits=limits)
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
        top_k: int = 5,
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
        """
        rid = request.request_id or uuid.uuid4().hex
        marker_key = REQUEST_KEY.format(id=rid)
        fingerprint = request_fingerprint(request)
        rate_limited = rate_key is not None and self.settings.admission.rate_capacity > 0
        if rate_limited or not admit:  # a known ID must not spend rate tokens: look it up first
            known = self.redis.get(marker_key)
            if known is not None:
                return self._resubmitted(rid, known, fingerprint)
        if admit:
            try:  # usually no Redis command at all (producer.admission.DepthCache)
                self.admission.admit(request.model, rate_key=rate_key)
            except (QueueFull, RateLimited):
                known = self.redis.get(marker_key)  # a known ID answers with its ID, even at the cap
                if known is None:
                    raise
                return self._resubmitted(rid, known, fingerprint)
        marker = json.dumps(
            {
                "model": request.model,
                "submitted_at_unix_s": request.submitted_at_unix_s,
                "kind": request.output.kind,
                "fingerprint": fingerprint,
            }
        )
        if not self.redis.set(marker_key, marker, nx=True, ex=self.settings.result_ttl_s):
            return self._resubmitted(rid, self.redis.get(marker_key), fingerprint)  # known, or a concurrent twin won
        model = request.model
        queue = self.router.queue(model, role) if role else self.router.choose(model, routing_key or rid)
        args = [request.model_dump(mode="json", exclude_none=True)]
        argsrepr = request_argsrepr(request, text)
        try:
            if self.writer.usable():  # one pipeline: LPUSH + the task-sent event (producer.task_writer)
                self.writer.send(TASK_NAME, rid, queue, args, argsrepr=argsrepr, kwargsrepr="{}")
            else:
                _quiet_backend(self.app)
                self.app.send_task(TASK_NAME, args=args, task_id=rid, queue=queue, argsrepr=argsrepr,
                                   kwargsrepr="{}")  # fmt: skip
        except Exception:
            self._forget_marker(marker_key, marker)  # not queued: let a retry with this ID queue it
            raise
        if role is None:  # not a shadow request itself
            self.router.sample_prompt(model, rid, request.input_ids)
        return rid

    def _forget_marker(self, marker_key: str, marker: str) -> None:
        """Delete this submit's own 'queued' marker after its task could not be queued (best effort)."""
        try:
            if self.redis.get(marker_key) == marker.encode():
                self.redis.delete(marker_key)
        except Exception:  # Redis is what failed: the marker expires with result_ttl_s
            pass

    @staticmethod
    def _resubmitted(request_id: str, marker: bytes | None, fingerprint: str) -> str:
        """A known ID: the same body is the same request (returns its ID); another body is refused."""
        try:
            known = json.loads(marker).get("fingerprint") if marker else None
        except (ValueError, AttributeError):
            known = None
        if known is not None and known != fingerprint:
            raise IdempotencyConflict(
                f"request_id {request_id!r} is already known with a different body; nothing was queued "
                "(an idempotency key names one request: reuse it only to resubmit the same request)",
                "request_id",
                None,
            )
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
        """Submit many requests (token-id lists or texts) in order; returns their IDs.

        ``threads`` > 1 submits from that many threads at once (concurrent producers); a progress
        bar shows when ``progress``. Every request is validated first, so a bad one raises before
        any of them is queued.
        """
        from concurrent.futures import ThreadPoolExecutor

        from tqdm import tqdm

        requests = [
            self.build_request(model, text=item, **options)
            if isinstance(item, str)
            else self.build_request(model, item, **options)
            for item in inputs
        ]
        with tqdm(total=len(requests), desc=f"submit {model}", unit="req", disable=not progress) as bar:

            def send_one(request: InferenceRequest) -> str:
                rid = self.send(request)
                bar.update(1)
                return rid

            if threads <= 1:
                return [send_one(r) for r in requests]
            with ThreadPoolExecutor(threads) as pool:
                return list(pool.map(send_one, requests))

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
        """Queue many requests as ``fleet.infer_bulk`` messages of ``chunk_size`` requests each.

        Each request still gets its own ID and result (``result``/``wait``/``status`` work as for
        ``submit``), but the broker and backend work is paid per message: use it when one Celery
        task per request is the bottleneck. Flower shows the bulk tasks, not each request.
        With a canary set, each chunk is split by role (sticky by ``routing_keys[i]``, default the
        request IDs) into one message per role queue.

        Raises:
            InvalidRequest: a bad request (nothing is queued); QueueFull / RateLimited from admission.
        """
        from tqdm import tqdm

        if not 1 <= chunk_size <= MAX_BULK_REQUESTS:
            raise InvalidRequest(f"chunk_size must be in [1, {MAX_BULK_REQUESTS}]", "chunk_size", MAX_BULK_REQUESTS)
        requests = [
            self.build_request(model, text=item, **options)
            if isinstance(item, str)
            else self.build_request(model, item, **options)
            for item in inputs
        ]
        key = self.settings.model_key(model)
        keys = list(routing_keys) if routing_keys is not None else [str(r.request_id) for r in requests]
        if len(keys) != len(requests):
            raise InvalidRequest(f"routing_keys has {len(keys)} keys for {len(requests)} inputs", "routing_keys",
                                 len(requests))
        ids: list[str] = []
        with tqdm(total=len(requests), desc=f"bulk {key}", unit="req", disable=not progress) as bar:
            for start in range(0, len(requests), chunk_size):
                chunk = requests[start : start + chunk_size]
                self.admission.admit(key, count=len(chunk), rate_key=rate_key)
                with self.redis.pipeline(transaction=False) as pipe:
                    for r in chunk:
                        marker = json.dumps(
                            {
                                "model": key,
                                "submitted_at_unix_s": r.submitted_at_unix_s,
                                "kind": r.output.kind,
                                "fingerprint": request_fingerprint(r),
                            }
                        )
                        pipe.set(REQUEST_KEY.format(id=r.request_id), marker, ex=self.settings.result_ttl_s)
                    pipe.execute()
                by_queue: dict[str, list[InferenceRequest]] = {}
                for r, routing_key in zip(chunk, keys[start : start + chunk_size], strict=True):
                    by_queue.setdefault(self.router.choose(key, routing_key), []).append(r)
                _quiet_backend(self.app)
                for queue, part in by_queue.items():
                    self.app.send_task(
                        BULK_TASK_NAME,
                        args=[{"requests": [r.model_dump(mode="json", exclude_none=True) for r in part]}],
                        queue=queue,
                    )
                ids.extend(str(r.request_id) for r in chunk)
                bar.update(len(chunk))
        return ids
