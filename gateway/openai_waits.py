"""Waiting for an OpenAI call's results while its client stays, and ending the wait: the client left
(499, its requests cancelled), no worker of the model came within ``api.no_worker_wait_s`` (503, cancelled),
or a failure in OpenAI's error shape with the caller's field names. Waits are on the event loop
(:mod:`gateway.outcomes`), at most ``WAIT_S`` seconds.
"""

from __future__ import annotations

import logging
from functools import partial

import redis
from fastapi import Request, Response

from gateway.deps import Gateway
from gateway.disconnect import ClientLeft, unless_client_leaves
from gateway.errors import fleet_error_response
from gateway.openai_mapping import rename_field
from gateway.outcomes import WAIT_S, await_outcomes
from protocol.cancel_marks import MARK_SCRIPT, mark_args, mark_keys
from protocol.errors import FleetError, NoLiveWorker
from protocol.messages import InferenceResult

__all__ = ["CLIENT_CLOSED_REQUEST", "cancel_requests", "give_up_waiting", "outcome_or_error"]

log = logging.getLogger("fleet.api")

CLIENT_CLOSED_REQUEST = 499
"""The status logged for a call whose client left before its answer (nginx's convention; nobody receives it)."""


async def outcome_or_error(
    gw: Gateway, http: Request, rid: str, model: str, headers: dict[str, str], field_names: dict[str, str]
) -> InferenceResult | Response:
    """Wait for ``rid``'s result while its client stays (at most ``WAIT_S``); every other end is the error
    response to send: the client left (499, the request cancelled), no worker came (503, cancelled), a
    failure (its fields renamed to the caller's: ``field_names``, OpenAI's shape)."""
    try:
        waiting = await_outcomes(gw.fleet, gw.aredis, [rid], timeout_s=WAIT_S, model=model,
                                 no_worker_after_s=gw.settings.api.no_worker_wait_s, presence=gw.apresence,
                                 notifier=gw.results)
        outcome = (await unless_client_leaves(http, waiting, partial(cancel_requests, gw, [rid])))[rid]
    except ClientLeft:
        return Response(status_code=CLIENT_CLOSED_REQUEST, headers=headers)
    except NoLiveWorker as exc:
        return fleet_error_response(await give_up_waiting(gw, [rid], exc), openai=True, headers=headers)
    except FleetError as exc:
        return fleet_error_response(exc, openai=True, headers=headers)
    if isinstance(outcome, FleetError):
        return fleet_error_response(rename_field(outcome, field_names, "output.generation."), openai=True,
                                    headers=headers)  # fmt: skip
    return outcome


async def give_up_waiting(gw: Gateway, rids: list[str], exc: NoLiveWorker) -> NoLiveWorker:
    """No worker came within ``api.no_worker_wait_s``: the caller gets an error, so nothing runs for it later
    (an SDK retries a 503 as a new request); the queued items still count for a scaler watching the queue."""
    await cancel_requests(gw, rids)
    return NoLiveWorker(f"{exc.message}; request {', '.join(rids)} was cancelled: retry once a worker is up",
                        exc.field, exc.limit)


async def cancel_requests(gw: Gateway, rids: list[str]) -> None:
    """The client left before its answer: mark the requests cancelled and tell the running workers."""
    script = gw.aredis.register_script(MARK_SCRIPT)  # the mark says whether a worker held it (protocol.cancel_marks)
    try:
        async with gw.aredis.pipeline(transaction=False) as pipe:
            for rid in rids:
                await script(keys=mark_keys(rid), args=mark_args(rid, gw.settings.result_ttl_s), client=pipe)
            await pipe.execute()
    except redis.RedisError as exc:
        log.warning("could not cancel %s after its client left: %s", ",".join(rids), exc)
