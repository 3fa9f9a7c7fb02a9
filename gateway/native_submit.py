"""The steps of a native submit (``POST /v1/requests`` and ``:batch``, :mod:`gateway.requests_routes`):
a body built and validated as a worker would, the wait a submit asked for (``wait_s`` or
``Prefer: wait``, s, at most ``api.max_wait_s``), the request queued (with the others that arrive
meanwhile, or alone in a thread), and the 202's body, with a warning when no live worker serves the model.
Either way the caller's owner mark is claimed before the request is queued (:mod:`gateway.request_owners`).
"""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool

from gateway.deps import Gateway
from gateway.prefer import prefer_wait_s
from gateway.schema import RequestAccepted, SubmitBody
from producer.client import RequestStatus
from producer.presence import no_worker_message
from producer.submit_groups import SubmitItem
from protocol.errors import InvalidRequest
from protocol.messages import InferenceRequest

__all__ = [
    "accepted",
    "build_submitted",
    "checked_wait",
    "no_worker_warning",
    "no_worker_warning_now",
    "queue_submitted",
    "send_owned",
    "submit_wait",
]


def build_submitted(gw: Gateway, body: SubmitBody) -> InferenceRequest:
    """Validate and tokenize ``body`` exactly as a worker would (raises InvalidRequest)."""
    return gw.fleet.build_request(
        body.model,
        body.input_ids,
        text=body.text,
        request_id=body.request_id,
        top_k=body.output.top_k if "top_k" in body.output.model_fields_set else None,  # a default is no choice
        normalize=body.output.normalize,
        kind=body.output.kind,
        deadline_s=body.deadline_s,
        generation=body.output.generation,
    )


def accepted(rid: str, status: RequestStatus = RequestStatus.QUEUED, warning: str | None = None) -> RequestAccepted:
    """The 202's body for ``rid``: its status, where to poll it, and a ``warning`` (None: none)."""
    return RequestAccepted(request_id=rid, status=status, location=f"/v1/requests/{rid}", warning=warning)


def no_worker_warning(gw: Gateway, model: str | None) -> str | None:
    """Accepted all the same (a fleet scaled to zero starts on its queue), but said: no live worker serves it."""
    if model is None or gw.presence.has_worker(model):
        return None
    return no_worker_message(model, gw.settings.queue_for(model))


async def no_worker_warning_now(gw: Gateway, model: str | None) -> str | None:
    """:func:`no_worker_warning` on the event loop (the asyncio heartbeat reader)."""
    if model is None or await gw.apresence.has_worker(model):
        return None
    return no_worker_message(model, gw.settings.queue_for(model))


def submit_wait(gw: Gateway, wait_s: float | None, prefer: str | None) -> tuple[float, dict[str, str]]:
    """How long a submit waits for its result (s; 0 = not at all) and the headers that say so.

    ``wait_s`` over ``api.max_wait_s`` is refused (InvalidRequest naming ``wait_s``); ``Prefer: wait`` is a
    preference (RFC 7240): a longer one is cut to the limit, an unreadable one ignored."""
    if wait_s is not None:
        return checked_wait(gw, wait_s), {}
    preferred = prefer_wait_s(prefer)
    if preferred is None:
        return 0.0, {}
    wait = min(preferred, gw.settings.api.max_wait_s)
    return wait, {"Preference-Applied": f"wait={wait:g}"}


def checked_wait(gw: Gateway, wait_s: float) -> float:
    """``wait_s`` (a long-poll's bound, s), refused (InvalidRequest naming ``wait_s``) over ``api.max_wait_s``."""
    cap = gw.settings.api.max_wait_s
    if wait_s > cap:
        raise InvalidRequest(f"wait_s = {wait_s} exceeds the long-poll limit api.max_wait_s={cap}", "wait_s", cap)
    return wait_s


async def queue_submitted(
    gw: Gateway, request: InferenceRequest, rate_key: str, body: SubmitBody
) -> tuple[str, RequestStatus]:
    """Queue ``request``: with the others that arrive meanwhile (no caller-given ID, ``api.group_submits``), or
    alone; its ID and status (a caller-given ID's real one)."""
    if body.request_id is None and gw.settings.api.group_submits:
        item = SubmitItem([request], rate_key, [body.routing_key])
        return (await gw.submits.submit(item))[0], RequestStatus.QUEUED
    return await run_in_threadpool(_send_one, gw, request, rate_key, body)


def _send_one(gw: Gateway, request: InferenceRequest, rate_key: str, body: SubmitBody) -> tuple[str, RequestStatus]:
    """``FleetClient.send`` (blocking: in a thread): the request's ID and, for a caller-given ID, its real status.

    The caller's owner mark is claimed first (:mod:`gateway.request_owners`): an ID another key's request holds
    is refused (IdempotencyConflict) before anything is queued."""
    rid = send_owned(gw, request, rate_key=rate_key, routing_key=body.routing_key)
    return rid, gw.fleet.status(rid) if body.request_id else RequestStatus.QUEUED


def send_owned(gw: Gateway, request: InferenceRequest, *, rate_key: str, routing_key: str | None) -> str:
    """``FleetClient.send`` of ``request`` (blocking: in a thread) after claiming its owner mark for the caller whose
    rate bucket is ``rate_key`` (:mod:`gateway.request_owners`); its ID. Every gateway route that queues a request
    alone goes through here, so the request is its key's under ``/v1/requests`` whatever face it came through.

    Raises:
        IdempotencyConflict: the ID is another key's request (nothing queued), or as ``FleetClient.send``.
        Whatever ``FleetClient.send`` raises (QueueFull, RateLimited, SubmitInterrupted, ...).
    """
    owner = gw.owners.owner_for(rate_key)
    with gw.owners.claimed([str(request.request_id)], [owner]):
        return gw.fleet.send(request, rate_key=rate_key, routing_key=routing_key)
