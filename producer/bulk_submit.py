"""Submitting many requests in one call: ``FleetClient.submit_many`` and ``FleetClient.submit_bulk``.

Both build (validate, tokenize) every request before anything is queued, and both keep the
idempotency of a single submit (:mod:`producer.idempotent_queue`): inputs under one request ID
must carry one body (the same body twice is one request, queued once; another body is refused
before anything is queued), and an ID already known is that request, never queued again.

When Redis fails midway (connection reset, timeout, a restart), both raise
:class:`~protocol.errors.SubmitInterrupted` (the Redis error as its ``__cause__``), which splits the call's
IDs into queued, unknown (their Redis step was in flight) and unqueued, and holds every input's ID in
``request_ids``: the same call again with ``request_ids=exc.request_ids`` queues what is missing and nothing
twice.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import redis
from kombu.exceptions import OperationalError as KombuOperationalError

from broker import bulk_argsrepr, mark_bulk_queues
from producer.arguments import checked_inputs, integer, labelled
from producer.idempotent_queue import one_body_per_id, quiet_backend, request_fingerprint
from producer.task_writer import TaskMessage, owners_header
from protocol.errors import AdmissionRefused, IdempotencyConflict, InvalidRequest, SubmitInterrupted
from protocol.messages import BULK_TASK_NAME, MAX_BULK_REQUESTS, InferenceRequest
from protocol.redis_conn import describe_redis_error

if TYPE_CHECKING:
    from producer.client import FleetClient

__all__ = ["REDIS_FAILURES", "interrupted", "queue_bulk_chunk", "submit_bulk", "submit_many"]

REDIS_FAILURES = (redis.RedisError, KombuOperationalError)
"""What a Redis failure raises on the submit paths: redis-py's errors (the claim-and-queue script) and kombu's
(Celery's ``send_task`` where tasks are not written as raw envelopes)."""
Refusal = AdmissionRefused | IdempotencyConflict
"""What stops a batch call midway and carries ``queued_ids``."""


def _build_all(client: FleetClient, model: str, inputs: Iterable[Sequence[int] | str],
               options: dict[str, Any], request_ids: Sequence[str] | None) -> list[InferenceRequest]:  # fmt: skip
    """Every input built (validated, tokenized), input i under ``request_ids[i]`` when given; an error names its
    input: ``inputs[i].<field>``, and its message starts ``inputs[i]: `` (same class as ``build_request`` raised).

    Raises:
        InvalidRequest: ``inputs`` itself is a string, bytes or not iterable (named ``inputs``); a bad input;
            ``request_ids`` with ``request_id`` in ``options``, or not one ID per input (named ``request_ids``).
        UnknownModel: ``model`` is not configured (named ``model``, not an input).
    """
    items = list(checked_inputs(inputs))
    client.settings.model_key(model)  # an unknown model is no input's fault
    if request_ids is not None and (isinstance(request_ids, str | bytes) or "request_id" in options):
        raise InvalidRequest("request_ids must be a list of IDs, one per input, given without request_id",
                             "request_ids", len(items))  # fmt: skip
    ids = list(request_ids) if request_ids is not None else None
    if ids is not None and len(ids) != len(items):
        raise InvalidRequest(f"request_ids has {len(ids)} IDs for {len(items)} inputs", "request_ids", len(items))

    def build(n: int) -> InferenceRequest:
        item = items[n]
        own: dict[str, Any] = {"request_id": ids[n]} if ids is not None else {}
        if isinstance(item, str):
            return client.build_request(model, text=item, **options, **own)
        return client.build_request(model, item, **options, **own)

    return labelled(range(len(items)), build, lambda i: f"inputs[{i}]")  # each built with its ID (a fresh one)


def interrupted(call: str, client: FleetClient, exc: BaseException, ids: Sequence[str], queued: Collection[int],
                unknown: Collection[int]) -> SubmitInterrupted:  # fmt: skip
    """The error of ``call`` stopped by Redis failure ``exc``: the IDs at positions ``queued`` (queued or known),
    ``unknown`` (their Redis step was in flight), and the rest (never sent), each in input order, once."""

    def at(positions: Collection[int]) -> list[str]:
        return list(dict.fromkeys(ids[i] for i in sorted(positions)))

    queued_ids = at(queued)
    unknown_ids = [rid for rid in at(unknown) if rid not in set(queued_ids)]
    sent = set(queued_ids) | set(unknown_ids)
    unqueued_ids = [rid for rid in dict.fromkeys(ids) if rid not in sent]
    why = describe_redis_error(exc, client.settings)
    if len(ids) == 1:
        message = (f"{call} stopped: {why}. Request {ids[0]} may or may not be queued (unknown_ids: its Redis step "
                   f"was in flight); submitting it again with request_id={ids[0]!r} (`fleet submit --request-id "
                   f"{ids[0]}`) and the same body is safe: a request ID is queued at most once")  # fmt: skip
    else:
        message = (f"{call} stopped: {why}. Of {len(sent) + len(unqueued_ids)} requests, {len(queued_ids)} are "
                   f"queued (queued_ids), {len(unknown_ids)} may or may not be (unknown_ids: their Redis step was in "
                   f"flight) and {len(unqueued_ids)} were not (unqueued_ids); the same call again with "
                   "request_ids=exc.request_ids is safe: a request ID is queued at most once, so what is queued is "
                   "not queued again")  # fmt: skip
    return SubmitInterrupted(message, "redis_url", None, queued_ids, unknown_ids, unqueued_ids, list(ids))


def _refused_after(exc: Refusal, requests: Sequence[InferenceRequest], queued: set[int]) -> Refusal:
    """``exc`` with ``queued_ids`` set: the IDs (in input order, a repeated one once) of the requests queued
    (or known already) before admission, or a conflicting ID, refused the rest."""
    exc.queued_ids = list(dict.fromkeys(str(requests[i].request_id) for i in sorted(queued)))
    return exc


def _firsts(requests: Sequence[InferenceRequest]) -> list[int]:
    """Each input's first position under its ID (:func:`one_body_per_id`, labelled ``inputs[i]``)."""
    ids = [str(r.request_id) for r in requests]
    return one_body_per_id(ids, [request_fingerprint(r) for r in requests], lambda i: f"inputs[{i}]")


def submit_many(
    client: FleetClient,
    model: str,
    inputs: Iterable[Sequence[int] | str],
    *,
    progress: bool = True,
    threads: int = 1,
    request_ids: Sequence[str] | None = None,
    **options: Any,
) -> list[str]:
    """Submit many requests (token-id lists or texts) in order, each with ``client.send``; returns their IDs.

    ``threads`` > 1 submits from that many threads at once (concurrent producers); a progress
    bar shows when ``progress``. Every request is validated first, so a bad one raises before
    any of them is queued; so does one ID given to inputs with different bodies (a
    ``request_id`` in ``options`` names every input: the same body is one request, queued once;
    ``request_ids`` names each input, one ID per input). After the first failure no request is sent.

    Raises:
        InvalidRequest: a bad input (named ``inputs[i].<field>``), or ``inputs`` is a string or bytes (named
            ``inputs``).
        IdempotencyConflict: ``inputs[i]`` under a known ID with another body (a repeat inside ``inputs`` is
            refused before anything is queued); the requests before it stay queued: ``queued_ids``.
        QueueFull / RateLimited: from admission; the requests before it stay queued, and the exception's
            ``queued_ids`` lists their IDs (in input order).
        SubmitInterrupted: Redis failed; the requests sent before stay queued (``queued_ids``), those in flight
            are ``unknown_ids`` (one per thread at most), the rest ``unqueued_ids``; ``request_ids`` to submit again.
    """
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm

    threads = integer(threads, "threads")
    requests = _build_all(client, model, inputs, options, request_ids)
    firsts = _firsts(requests)
    unique = [i for i, j in enumerate(firsts) if i == j]
    queued: set[int] = set()
    started: set[int] = set()
    failed = threading.Event()  # set at the first failure: the threads send nothing more
    with tqdm(total=len(requests), desc=f"submit {model}", unit="req", disable=not progress) as bar:

        def send_one(i: int) -> str:
            if failed.is_set():
                return ""  # never returned: the failure that set it is raised
            started.add(i)
            try:
                rid = client.send(requests[i])
            except BaseException as exc:
                failed.set()
                if not isinstance(exc, SubmitInterrupted):  # refused or failed before its queue step: not queued
                    started.discard(i)
                raise
            queued.add(i)
            bar.update(1)
            return rid

        try:
            if threads <= 1:
                sent = [send_one(i) for i in unique]
            else:
                with ThreadPoolExecutor(threads) as pool:
                    sent = list(pool.map(send_one, unique))
        except (AdmissionRefused, IdempotencyConflict) as exc:
            raise _refused_after(exc, requests, queued) from None
        except REDIS_FAILURES as exc:  # client.send's SubmitInterrupted (its request's step) or Redis's own error
            cause = exc.__cause__ if isinstance(exc, SubmitInterrupted) and exc.__cause__ is not None else exc
            ids = [str(r.request_id) for r in requests]
            raise interrupted("submit_many", client, cause, ids, queued, started - queued) from cause
        bar.update(len(requests) - len(unique))
    by_first = dict(zip(unique, sent, strict=True))
    return [by_first[j] for j in firsts]


def submit_bulk(
    client: FleetClient,
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
    """Queue many requests as ``fleet.infer_bulk`` messages of ``chunk_size`` requests each.

    Each request still gets its own ID and result (``result``/``wait``/``status`` work as for
    ``submit``), but the broker and backend work is paid per message: use it when one Celery
    task per request is the bottleneck. Flower shows the bulk tasks, not each request.
    With a canary set, each chunk is split by role (sticky by ``routing_keys[i]``, default the
    request IDs) into one message per role queue.

    Request IDs are idempotency keys as for ``submit``: every ID of the call is checked before
    anything is queued (inputs under one ID must have one body: a ``request_id`` in ``options``
    names every input, ``request_ids`` each input); an ID already known with the same body is that
    request, returned and not queued again. A chunk's markers and messages are written in one Redis
    step, all or none.

    Raises:
        InvalidRequest: a bad request (named ``inputs[i].<field>``; nothing is queued); ``inputs`` is a string
            or bytes (named ``inputs``); a chunk larger than the model's ``max_queue_depth`` (named
            ``chunk_size``, the cap as its limit: such a chunk could never be admitted, so it is not
            QueueFull, which says to retry).
        QueueFull / RateLimited: from admission; the chunks before stay queued, and the exception's
            ``queued_ids`` lists their requests' IDs (in input order).
        IdempotencyConflict: ``inputs[i]`` under a known or repeated ID with another body (nothing
            of its chunk, nor of the chunks after it, is queued; the chunks before are: ``queued_ids``).
        SubmitInterrupted: Redis failed; the chunks before stay queued (``queued_ids``), the chunk whose Redis
            step was in flight is ``unknown_ids``, the chunks after ``unqueued_ids``; ``request_ids`` holds every
            input's ID, to submit the same inputs again.
    """
    from tqdm import tqdm

    chunk_size = integer(chunk_size, "chunk_size")
    if not 1 <= chunk_size <= MAX_BULK_REQUESTS:
        raise InvalidRequest(f"chunk_size must be in [1, {MAX_BULK_REQUESTS}]", "chunk_size", MAX_BULK_REQUESTS)
    requests = _build_all(client, model, inputs, options, request_ids)
    key = client.settings.model_key(model)
    keys = list(routing_keys) if routing_keys is not None else [str(r.request_id) for r in requests]
    if len(keys) != len(requests):
        raise InvalidRequest(f"routing_keys has {len(keys)} keys for {len(requests)} inputs", "routing_keys",
                             len(requests))  # fmt: skip
    firsts = _firsts(requests)
    unique = [i for i, j in enumerate(firsts) if i == j]  # a repeated ID (same body) is queued once
    cap = client.settings.models[key].max_queue_depth
    if min(chunk_size, len(unique)) > cap:
        size = min(chunk_size, len(unique))
        raise InvalidRequest(f"chunk_size={chunk_size} puts {size} requests in one chunk, more than "
                             f"models.{key}.max_queue_depth={cap} lets wait: such a chunk is never admitted, even "
                             f"on an empty queue; use chunk_size <= {cap}", "chunk_size", cap)  # fmt: skip
    queued: set[int] = set()
    with tqdm(total=len(requests), desc=f"bulk {key}", unit="req", disable=not progress) as bar:
        for start in range(0, len(unique), chunk_size):
            positions = unique[start : start + chunk_size]
            in_flight: list[int] = []  # admission queues nothing: a failure there leaves the chunk unqueued
            try:
                client.admission.admit(key, count=len(positions), rate_key=rate_key)
                in_flight = positions
                queue_bulk_chunk(client, key, requests, keys, positions)
            except (AdmissionRefused, IdempotencyConflict) as exc:
                raise _refused_after(exc, requests, queued) from None
            except REDIS_FAILURES as exc:
                ids = [str(r.request_id) for r in requests]
                raise interrupted("submit_bulk", client, exc, ids, queued, in_flight) from exc
            queued.update(positions)
            bar.update(len(positions))
        bar.update(len(requests) - len(unique))
    return [str(r.request_id) for r in requests]


def queue_bulk_chunk(client: FleetClient, model: str, requests: list[InferenceRequest], routing_keys: list[str],
                 positions: list[int]) -> None:  # fmt: skip
    """Claim the IDs of ``requests[positions]`` (one chunk) and queue the new ones as ``fleet.infer_bulk``
    messages (one per queue), in one Redis step."""
    chunk = [requests[i] for i in positions]
    queues = [client.router.choose(model, routing_keys[i]) for i in positions]

    def parts(new: list[int]) -> dict[str, list[dict[str, Any]]]:
        by_queue: dict[str, list[dict[str, Any]]] = {}
        for i in new:
            by_queue.setdefault(queues[i], []).append(chunk[i].model_dump(mode="json", exclude_none=True))
        return by_queue

    def build(new: list[int]) -> list[TaskMessage]:
        return [client.writer.build(BULK_TASK_NAME, uuid.uuid4().hex, queue, [{"requests": part}],
                                    argsrepr=bulk_argsrepr(part), kwargsrepr="{}")
                for queue, part in parts(new).items()]  # fmt: skip

    def send(new: list[int], sent: list[int]) -> None:
        quiet_backend(client.app)
        for queue, part in parts(new).items():
            task_id, args = uuid.uuid4().hex, [{"requests": part}]
            client.app.send_task(BULK_TASK_NAME, args=args, task_id=task_id, queue=queue, argsrepr=bulk_argsrepr(part),
                                 headers=owners_header(task_id, args) or None)  # the owners, as build() gives them
            sent.extend(i for i in new if queues[i] == queue)

    mark_bulk_queues(client.redis, queues, client.settings.result_ttl_s)  # depth reads count them (broker.queue_weight)
    client.queuer.queue(chunk, build, send, label=lambda n: f"inputs[{positions[n]}]")
