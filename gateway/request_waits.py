"""A request's view once it is finished, waited for on the event loop: the waits of ``POST /v1/requests?wait_s=``
and of the long-poll ``GET /v1/requests/{id}?wait_s=`` (:mod:`gateway.requests_routes`), over the process's one result
subscription (:class:`gateway.result_notifier.ResultNotifier`). Each answers ``None`` (or the view as it is
then) at its bound, ``wait_s`` seconds.
"""

from __future__ import annotations

from gateway.deps import Gateway
from gateway.outcomes import await_outcomes, await_watched
from gateway.result_notifier import Watch
from gateway.schema import RequestView
from gateway.views import ViewRead, read_view, view_of_outcome
from producer.client import RequestStatus
from protocol.errors import ResultTimeout

__all__ = ["long_polled_view", "view_when_done", "view_when_published"]


async def view_when_published(gw: Gateway, request_id: str, watch: Watch, wait_s: float) -> RequestView | None:
    """:func:`view_when_done` for a request whose result channel ``watch`` subscribed before it was queued: no
    first read of its key (nothing can be stored yet), the result comes with its publication."""
    try:
        outcomes = await await_watched(gw.fleet, gw.aredis, [request_id], watch, timeout_s=wait_s)
    except ResultTimeout:
        return None
    return view_of_outcome(request_id, outcomes[request_id])


async def view_when_done(gw: Gateway, request_id: str, wait_s: float) -> RequestView | None:
    """The request's view once its result is stored, waiting at most ``wait_s`` s; None if it is not by then."""
    try:
        outcomes = await await_outcomes(gw.fleet, gw.aredis, [request_id], timeout_s=wait_s, notifier=gw.results)
    except ResultTimeout:
        return None
    return view_of_outcome(request_id, outcomes[request_id])


async def long_polled_view(gw: Gateway, request_id: str, wait_s: float) -> ViewRead:
    """The request's view once it is finished, or at ``wait_s`` s as it is then. Its result channel is
    subscribed before the view is read, so the view's own read of the result is the wait's first: a
    result stored after it is published to the wait (one round trip fewer than reading it again)."""
    key = gw.fleet.app.backend.get_key_for_task(request_id)
    async with gw.results.watching([key]) as watch:
        view, model = await read_view(gw.fleet, gw.aredis, request_id)
        if view.status not in (RequestStatus.QUEUED, RequestStatus.RUNNING):
            return view, model
        try:
            outcomes = await await_watched(gw.fleet, gw.aredis, [request_id], watch, timeout_s=wait_s)
        except ResultTimeout:  # the bound: answer with the status as it is then
            return await read_view(gw.fleet, gw.aredis, request_id)
    return view_of_outcome(request_id, outcomes[request_id]), model
