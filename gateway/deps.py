"""What every route of the gateway depends on: the :class:`Gateway` state and the caller's API key.

A key is accepted from either header: ``X-API-Key: <key>`` (the native API's) or
``Authorization: Bearer <key>`` (what the OpenAI SDKs send). With ``api.api_keys`` empty, no key is
needed. The key also names the caller's rate-limit bucket (:func:`producer.admission.rate_key_for`).
"""

from __future__ import annotations

from functools import partial
from typing import Annotated

import redis.asyncio
from fastapi import Depends, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CollectorRegistry
from starlette.exceptions import HTTPException

from gateway.auth import API_KEY_HEADER, key_refusal
from gateway.middleware import GatewayMetrics
from gateway.request_owners import RequestOwners
from gateway.result_notifier import ResultNotifier
from gateway.stream_hub import StreamHub
from gateway.submit_queue import SubmitQueue
from producer.admission import rate_key_for
from producer.client import FleetClient
from producer.presence import AsyncWorkerPresence, WorkerPresence
from producer.submit_groups import send_group
from protocol.redis_conn import async_client
from protocol.settings import FleetSettings

__all__ = ["API_KEY_HEADER", "MAX_REDIS_CONNECTIONS", "CallerDep", "Gateway", "GatewayDep", "gateway_of"]

MAX_REDIS_CONNECTIONS = 4096
"""Connections of the gateway's asyncio Redis pool. The open streams wait in one ``XREAD BLOCK``
(:class:`gateway.stream_hub.StreamHub`), but a stream that joins while that read is under way waits on a
connection of its own until it ends, and each waiting non-streaming call holds one per poll; past the
bound a call fails with 503 (redis-py's default is 100)."""
_api_key = APIKeyHeader(name=API_KEY_HEADER, auto_error=False, description="One of api.api_keys.")
_bearer = HTTPBearer(auto_error=False, description="One of api.api_keys, as the OpenAI SDKs send it.")


class Gateway:
    """Per-process state: settings, the client (sync Redis + Celery, for submits), an asyncio Redis
    client (for waiting on results and streams without a thread), and the metrics."""

    def __init__(self, settings: FleetSettings, fleet: FleetClient) -> None:
        self.settings = settings
        self.fleet = fleet
        self.aredis: redis.asyncio.Redis[bytes] = async_client(settings, max_connections=MAX_REDIS_CONNECTIONS)
        self.registry = CollectorRegistry()
        self.metrics = GatewayMetrics(self.registry, settings, fleet.redis, fleet.router.prefixes)
        self.keys = [k.encode() for k in settings.api.api_keys]
        self.owners = RequestOwners(fleet.redis, self.keys, settings.result_ttl_s)  # which key's each request is
        self.presence = WorkerPresence(fleet.redis)  # which models have a live worker (read at most once a second)
        self.apresence = AsyncWorkerPresence(self.aredis)  # the same, for waits on the event loop
        self.results = ResultNotifier(self.aredis)  # wakes result waits on publication (one pub/sub connection)
        self.streams = StreamHub(self.aredis)  # one XREAD waits for every relayed token stream
        self.submits = SubmitQueue(partial(send_group, fleet), max_group_requests=settings.api.max_grouped_requests,
                                   registry=self.registry, owners=self.owners)  # fmt: skip

    async def aclose(self) -> None:
        """Close both Redis clients and the Celery app."""
        await self.streams.aclose()
        await self.results.aclose()
        await self.aredis.aclose()  # type: ignore[attr-defined]  # types-redis predates aclose
        self.fleet.close()


async def gateway_of(request: Request) -> Gateway:
    """The app's :class:`Gateway` (``async``: FastAPI runs a plain ``def`` dependency in its thread pool,
    a hop per request for nothing)."""
    gateway: Gateway = request.app.state.gateway
    return gateway


GatewayDep = Annotated[Gateway, Depends(gateway_of)]


async def _caller(
    api_key: Annotated[str | None, Depends(_api_key)],
    bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    gw: GatewayDep,
) -> str:
    """The caller's rate-limit bucket; 401 unless a key is one of api.api_keys (when any is set).

    ``async`` (no I/O): on the event loop, not a thread-pool hop."""
    key = api_key or (bearer.credentials if bearer else None)
    refusal = key_refusal(key, gw.keys)  # gateway.body_guard refused it already, before reading any body
    if refusal:
        raise HTTPException(401, refusal, headers={"WWW-Authenticate": "Bearer"})
    return rate_key_for(key)


CallerDep = Annotated[str, Depends(_caller)]
