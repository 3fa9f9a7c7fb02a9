"""Submitting many requests in one call: ``FleetClient.submit_many`` and ``FleetClient.submit_bulk``.

Both build (validate, tokenize) every request before anything is queued, and both keep the
idempotency of a single submit (:mod:`producer.idempotent_queue`): inputs under one request ID
must carry one body (the same body twice is one request, queued once; another body is refused
before anything is queued), and an ID already known is that request, never queued again.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from producer.arguments import checked_inputs, integer, labelled
from producer.idempotent_queue import one_body_per_id, quiet_backend, request_fingerprint
from producer.task_writer import TaskMessage
from protocol.errors import AdmissionRefused, InvalidRequest
from protocol.messages import BULK_TASK_NAME, MAX_BULK_REQUESTS, InferenceRequest

if TYPE_CHECKING:
    from producer.client import FleetClient

__all__ = ["queue_bulk_chunk", "submit_bulk", "submit_many"]


def _build_all(client: FleetClient, model: str, inputs: Iterable[Sequence[int] | str],
               options: dict[str, Any]) -> list[InferenceRequest]:  # fmt: skip
    """Every input built (validated, tokenized); an error names its input: ``inputs[i].<field>``, and its message
    starts ``inputs[i]: `` (same class as ``build_request`` raised).

    Raises:
        InvalidRequest: ``inputs`` itself is a string, bytes or not iterable (named ``inputs``); a bad input.
        UnknownModel: ``model`` is not configured (named ``model``, not an input).
    """
    checked_inputs(inputs)
    client.settings.model_key(model)  # an unknown model is no input's fault

    def build(item: Sequence[int] | str) -> InferenceRequest:
        if isinstance(item, str):
            return client.build_request(model, text=item, **options)
        return client.build_request(model, item, **options)

    return labelled(inputs, build, lambda i: f"inputs[{i}]")


def _refused_after(exc: AdmissionRefused, requests: Sequence[InferenceRequest], queued: set[int]) -> AdmissionRefused:
    """``exc`` with ``queued_ids`` set: the IDs (in input order, a repeated one once) of the requests queued
    (or known already) before admission refused the rest."""
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
    **options: Any,
) -> list[str]:
    """Submit many requests (token-id lists or texts) in order, each with ``client.send``; returns their IDs.

    ``threads`` > 1 submits from that many threads at once (concurrent producers); a progress
    bar shows when ``progress``. Every request is validated first, so a bad one raises before
    any of them is queued; so does one ID given to inputs with different bodies (a
    ``request_id`` in ``options`` names every input: the same body is one request, queued once).

    Raises:
        InvalidRequest: a bad input (named ``inputs[i].<field>``), or ``inputs`` is a string or bytes (named
            ``inputs``); IdempotencyConflict: ``inputs[i]`` under a known or repeated ID with another body.
        QueueFull / RateLimited: from admission; the requests before it stay queued, and the exception's
            ``queued_ids`` lists their IDs (in input order).
    """
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm

    threads = integer(threads, "threads")
    requests = _build_all(client, model, inputs, options)
    firsts = _firsts(requests)
    unique = [i for i, j in enumerate(firsts) if i == j]
    queued: set[int] = set()
    with tqdm(total=len(requests), desc=f"submit {model}", unit="req", disable=not progress) as bar:

        def send_one(i: int) -> str:
            rid = client.send(requests[i])
            queued.add(i)
            bar.update(1)
            return rid

        try:
            if threads <= 1:
                sent = [send_one(i) for i in unique]
            else:
                with ThreadPoolExecutor(threads) as pool:
                    sent = list(pool.map(send_one, unique))
        except AdmissionRefused as exc:
            raise _refused_after(exc, requests, queued) from None
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
    names every input); an ID already known with the same body is that request, returned and not
    queued again. A chunk's markers and messages are written in one Redis step, all or none.

    Raises:
        InvalidRequest: a bad request (named ``inputs[i].<field>``; nothing is queued); ``inputs`` is a string
            or bytes (named ``inputs``); a chunk larger than the model's ``max_queue_depth`` (named
            ``chunk_size``, the cap as its limit: such a chunk could never be admitted, so it is not
            QueueFull, which says to retry).
        QueueFull / RateLimited: from admission; the chunks before stay queued, and the exception's
            ``queued_ids`` lists their requests' IDs (in input order).
        IdempotencyConflict: ``inputs[i]`` under a known or repeated ID with another body (nothing
            of its chunk, nor of the chunks after it, is queued).
    """
    from tqdm import tqdm

    chunk_size = integer(chunk_size, "chunk_size")
    if not 1 <= chunk_size <= MAX_BULK_REQUESTS:
        raise InvalidRequest(f"chunk_size must be in [1, {MAX_BULK_REQUESTS}]", "chunk_size", MAX_BULK_REQUESTS)
    requests = _build_all(client, model, inputs, options)
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
            try:
                client.admission.admit(key, count=len(positions), rate_key=rate_key)
            except AdmissionRefused as exc:
                raise _refused_after(exc, requests, queued) from None
            queue_bulk_chunk(client, key, requests, keys, positions)
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
        return [client.writer.build(BULK_TASK_NAME, uuid.uuid4().hex, queue, [{"requests": part}], argsrepr=None,
                                    kwargsrepr="{}") for queue, part in parts(new).items()]  # fmt: skip

    def send(new: list[int], sent: list[int]) -> None:
        quiet_backend(client.app)
        for queue, part in parts(new).items():
            client.app.send_task(BULK_TASK_NAME, args=[{"requests": part}], queue=queue)
            sent.extend(i for i in new if queues[i] == queue)

    client.queuer.queue(chunk, build, send, label=lambda n: f"inputs[{positions[n]}]")
