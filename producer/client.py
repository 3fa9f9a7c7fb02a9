"""FleetClient: submit tokenized requests, get a request ID back at once, poll results by ID.

::

    client = FleetClient.from_settings()                # FLEET_* env + configs/fleet.yaml
    rid = client.submit("demo-lm", text="Hello")        # validated and tokenized here
    result = client.result(rid, wait=True, timeout_s=10)

Text is tokenized by the producer: what travels through Redis is always token ids. Every check
a worker makes is made here first, so bad input is refused before anything is queued.

The client is three parts: building requests (:class:`producer.request_builder.RequestBuilder`, over
the models' cards and tokenizers of :class:`producer.model_cards.ModelCards`), queueing them (here),
and reading them back by ID (:class:`producer.results.ResultReader`).
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from celery import Celery

from broker import make_celery
from producer import bulk_submit
from producer.admission import Admission
from producer.idempotent_queue import (
    IdempotentQueue,
    conflict,
    quiet_backend,
    request_fingerprint,
)
from producer.model_cards import CARD_MISS_TTL_S, ModelInfo
from producer.reprs import request_argsrepr
from producer.request_builder import MAX_DEADLINE_S, RequestBuilder
from producer.result_waiter import ResultWaiter
from producer.results import RequestStatus, ResultReader
from producer.routing import Router
from producer.submit_groups import generates
from producer.task_writer import TaskMessage, TaskWriter, owners_header
from protocol.celeryconf import celery_config
from protocol.errors import InvalidRequest, QueueFull, RateLimited
from protocol.keys import REQUEST_KEY
from protocol.messages import TASK_NAME, GenerationParams, InferenceRequest
from protocol.model_state import Role
from protocol.redis_conn import sync_client
from protocol.settings import FleetSettings, load_settings

__all__ = ["CARD_MISS_TTL_S", "MAX_DEADLINE_S", "FleetClient", "RequestStatus", "request_fingerprint"]


class FleetClient(RequestBuilder, ResultReader):
    """Producer-side API over Celery + Redis. Thread-safe for concurrent submits.

    Submitting lives here; building requests (cards, tokenizers, checks) in
    :class:`producer.request_builder.RequestBuilder`; reading back (status, results, waits, streams,
    cancels) in :class:`producer.results.ResultReader`.
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
        self._models: dict[str, ModelInfo] = {}
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
            SubmitInterrupted: Redis failed as the request was queued (see :meth:`send`).
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
            SubmitInterrupted: Redis failed in the step that queues it: whether it was queued is unknown; its ID
                (``unknown_ids[0]``, made here when the request had none) is the one to submit it again under.
                A ``redis.ConnectionError`` too; a Redis error before that step is raised as it is (nothing queued).
        """
        if request.request_id is None:
            request = request.model_copy(update={"request_id": uuid.uuid4().hex})
        rid = str(request.request_id)
        fingerprint = request_fingerprint(request)
        rate_limited = rate_key is not None and self.settings.admission.rate_capacity > 0
        if rate_limited or not admit:  # a known ID must not spend rate tokens: look it up first
            known = self.redis.get(REQUEST_KEY.format(id=rid))
            if known is not None:
                return self._known(rid, known, fingerprint)
        if admit:
            try:  # usually no Redis command at all (producer.admission.DepthCache)
                self.admission.admit(request.model, rate_key=rate_key)
            except (QueueFull, RateLimited):
                known = self.redis.get(REQUEST_KEY.format(id=rid))  # a known ID answers with its ID, even at the cap
                if known is None:
                    raise
                return self._known(rid, known, fingerprint)
        model = request.model
        queue = (
            self.router.queue(model, role)
            if role
            else self.router.choose(model, routing_key or rid, _generation_prompt(request))
        )
        try:
            new = self._queue_tasks([request], [queue], [request_argsrepr(request, text)])
        except bulk_submit.REDIS_FAILURES as exc:  # an ID the caller never saw would make a retry another request
            raise bulk_submit.interrupted("submit", self, exc, [rid], (), (0,)) from exc
        if new[0] and role is None:  # not a shadow request itself
            self._sample_prompt(request.model, rid, request.input_ids)
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
            SubmitInterrupted: Redis failed in the step that queues them: all or none of them are queued, which
                is unknown (``unknown_ids``: every ID, to send them again under). A ``redis.ConnectionError`` too.
        """
        keys = list(routing_keys) if routing_keys is not None else [None] * len(requests)
        if len(keys) != len(requests):
            raise InvalidRequest(f"routing_keys has {len(keys)} keys for {len(requests)} requests", "routing_keys",
                                 len(requests))  # fmt: skip
        requests = [r if r.request_id else r.model_copy(update={"request_id": uuid.uuid4().hex}) for r in requests]
        queues = self.router.choose_many(
            [(r.model, key or str(r.request_id), _generation_prompt(r)) for r, key in zip(requests, keys, strict=True)]
        )
        try:
            new = self._queue_tasks(requests, queues, [request_argsrepr(r, None) for r in requests],
                                    label=lambda i: f"{label}[{i}]")  # fmt: skip
        except bulk_submit.REDIS_FAILURES as exc:
            ids = [str(r.request_id) for r in requests]
            raise bulk_submit.interrupted("send_batch", self, exc, ids, (), range(len(ids))) from exc
        for r, fresh in zip(requests, new, strict=True):
            if fresh:
                self._sample_prompt(r.model, str(r.request_id), r.input_ids)
        return [str(r.request_id) for r in requests]

    def _sample_prompt(self, model: str, request_id: str, input_ids: Sequence[int]) -> None:
        """:meth:`Router.sample_prompt <producer.routing.Router.sample_prompt>` of a request just queued, best
        effort: a Redis error there must not read as "not queued" (a caller would send it again as another
        request); one lost shadow sample is harmless."""
        with contextlib.suppress(*bulk_submit.REDIS_FAILURES):
            self.router.sample_prompt(model, request_id, input_ids)

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
                rid, args = str(requests[i].request_id), args_of(i)  # the owners' header, as build() gives them
                self.app.send_task(TASK_NAME, args=args, task_id=rid, queue=queues[i], argsrepr=argsreprs[i],
                                   kwargsrepr="{}", headers=owners_header(rid, args) or None)  # fmt: skip
                sent.append(i)

        return self.queuer.queue(requests, build, send, label=label)

    def _known(self, request_id: str, marker: bytes, fingerprint: str) -> str:
        """:meth:`_resubmitted` of an ID found known before the queue step, which settles an owner mark the caller
        claimed for it as the queue step would (:meth:`IdempotentQueue.settle_known`)."""
        self._resubmitted(request_id, marker, fingerprint)
        self.queuer.settle_known(request_id)
        return request_id

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
        request_ids: Sequence[str] | None = None,
        **options: Any,
    ) -> list[str]:
        """Submit many requests (token-id lists or texts) in order, one ``fleet.infer`` task each; returns
        their IDs. See :func:`producer.bulk_submit.submit_many` (``threads``, ``progress``, ``request_ids``,
        what is raised)."""
        return bulk_submit.submit_many(self, model, inputs, progress=progress, threads=threads,
                                       request_ids=request_ids, **options)  # fmt: skip

    def submit_bulk(
        self,
        model: str,
        inputs: Iterable[Sequence[int] | str],
        *,
        chunk_size: int = 512,
        progress: bool = False,
        rate_key: str | None = None,
        routing_keys: Sequence[str] | None = None,
        request_ids: Sequence[str] | None = None,
        **options: Any,
    ) -> list[str]:
        """Queue many requests as ``fleet.infer_bulk`` messages of ``chunk_size`` requests each; returns
        their IDs. See :func:`producer.bulk_submit.submit_bulk` (idempotency, canary split, ``request_ids``,
        what is raised)."""
        return bulk_submit.submit_bulk(self, model, inputs, chunk_size=chunk_size, progress=progress,
                                       rate_key=rate_key, routing_keys=routing_keys, request_ids=request_ids,
                                       **options)  # fmt: skip


def _generation_prompt(request: InferenceRequest) -> list[int] | None:
    """The prompt of a generation (what prefix-aware routing looks at); None for any other request."""
    return list(request.input_ids) if generates(request) and request.input_ids else None
