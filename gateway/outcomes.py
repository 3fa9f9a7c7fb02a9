"""Wait for stored results on the event loop: poll ``celery-task-meta-<id>`` with ``MGET`` on
``redis.asyncio``, backing off from :data:`FIRST_POLL_S` to :data:`MAX_POLL_S`, so a waiting HTTP
request costs a coroutine, never a thread."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import redis.asyncio

from producer.client import FleetClient
from protocol.errors import FleetError, ResultTimeout
from protocol.messages import InferenceResult

__all__ = ["FIRST_POLL_S", "MAX_POLL_S", "WAIT_S", "await_outcomes"]

WAIT_S = 600.0
"""Longest wait of a gateway call for a result, and longest silence of a stream it relays (s); the
OpenAI SDKs give up after 600 s too. Past it: 504 (or an error event) naming the ID to poll."""

FIRST_POLL_S = 0.005
MAX_POLL_S = 0.1
Outcome = InferenceResult | FleetError


async def await_outcomes(
    fleet: FleetClient, aredis: redis.asyncio.Redis[bytes], request_ids: Sequence[str], *, timeout_s: float
) -> dict[str, Outcome]:
    """The result (or the error) of every one of ``request_ids``, once all are stored.

    Raises:
        ResultTimeout: some are still unfinished after ``timeout_s``; names the first of them.
    """
    backend = fleet.app.backend
    deadline = time.monotonic() + timeout_s
    poll_s = FIRST_POLL_S
    done: dict[str, Outcome] = {}
    remaining = list(dict.fromkeys(request_ids))
    while True:
        raws = await aredis.mget([backend.get_key_for_task(rid) for rid in remaining])
        for rid, raw in zip(remaining, raws, strict=True):
            if raw is not None:
                # the client's own reading of a stored meta, so every face reports the same outcome
                outcome = fleet.outcome_of(rid, backend.decode_result(raw))
                if outcome is not None:
                    done[rid] = outcome
        remaining = [rid for rid in remaining if rid not in done]
        if not remaining:
            return done
        if time.monotonic() >= deadline:
            msg = f"no result for {remaining[0]} within {timeout_s} s; poll GET /v1/requests/{remaining[0]}"
            raise ResultTimeout(msg, "timeout_s", timeout_s)
        await asyncio.sleep(poll_s)
        poll_s = min(MAX_POLL_S, poll_s * 1.5)
