"""ASGI middleware of the gateway: the body's bounds (bytes and time) and request metrics.

Both are plain ASGI (no ``BaseHTTPMiddleware``), so they neither buffer responses nor break
streaming. Metrics label requests by the *route template* (``/v1/requests/{request_id}``), never
by the raw path, so request IDs cannot blow up the series count.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import redis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from broker import pipe_waiting_counts
from gateway.body_guard import has_body, replaying, send_error
from gateway.errors import error_payload
from gateway.plain_numbers import is_plain_count
from producer.prefix_routing import PrefixRouter
from producer.registry import pipe_list_workers
from protocol.keys import DEAD_LETTER_COUNTS_KEY, DEAD_LETTER_KEY
from protocol.model_state import AUTO_ROLLBACKS_KEY, STATE_KEY, ModelState
from protocol.settings import FleetSettings

__all__ = ["BODY_TIMEOUT_S", "AccessLogMiddleware", "BodyLimitMiddleware", "GatewayMetrics", "MetricsMiddleware"]

access_log = logging.getLogger("fleet.access")
log = logging.getLogger("fleet.api")

BODY_TIMEOUT_S = 60.0
"""How long a request body may take to arrive once the gateway reads it (s; ``api.body_timeout_s``)."""
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class BodyLimitMiddleware:
    """Refuse bodies over ``max_bytes`` with 413, and bodies not sent within ``timeout_s`` with 408, before the
    app sees them.

    A declared ``Content-Length`` over the limit is refused at once; otherwise the body is read
    (at most ``max_bytes`` + one chunk) and replayed to the app. Reading it ends ``timeout_s`` after it
    began (``api.body_timeout_s``; the moment the gateway waits for the body, once the key is checked),
    whatever the framing (``Content-Length`` or chunked): a body that stops short of its end, or trickles,
    held its connection and a slot of ``api.max_concurrent_requests`` (counted before the body is read) for
    as long as the client kept the socket open. Both refusals close the connection.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float = BODY_TIMEOUT_S) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            if not is_plain_count(declared):  # int() reads b"1_0", b"+5", b" 5"; the HTTP parser refuses them first
                await self._refuse(scope, send, 400, "Content-Length is not an integer", None)
                return
            size = int(declared)
            if size > self.max_bytes:
                await self._refuse(scope, send, 413, f"request body has {size} bytes", size)
                return
        got = _BodyRead()
        try:  # no timer for a request without a body: its one message is there already
            async with asyncio.timeout(self.timeout_s if has_body(scope) else None):
                await self._read(receive, got)
        except TimeoutError:
            await self._too_slow(scope, send, got.size)
            return
        if got.gone:
            return
        if got.size > self.max_bytes:
            await self._refuse(scope, send, 413, f"request body exceeds {got.size} bytes", got.size)
            return
        body = b"".join(got.chunks)
        await self.app(scope, replaying(body, receive), send)

    async def _read(self, receive: Receive, got: _BodyRead) -> None:
        """Gather the body into ``got``, stopping once it is past ``max_bytes`` or the client went away."""
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                got.gone = True
                return
            chunk = message.get("body", b"")
            got.size += len(chunk)
            if got.size > self.max_bytes:
                return
            got.chunks.append(chunk)
            if not message.get("more_body", False):
                return

    async def _too_slow(self, scope: Scope, send: Send, received: int) -> None:
        limit = self.timeout_s
        client = scope.get("client")
        peer = f"{client[0]}:{client[1]}" if client else "a client"
        log.warning(
            "closed the connection of %s: its request body (%s %s) was not complete within %g s, %d bytes received "
            "(api.body_timeout_s)", peer, scope.get("method"), scope.get("path"), limit, received,
        )  # fmt: skip
        message = (f"the request body was not complete within {limit:g} s ({received} bytes received); the limit "
                   f"is api.body_timeout_s={limit:g}")  # fmt: skip
        payload = error_payload("request_timeout", "RequestTimeout", message, "body", limit)
        await send_error(scope, send, 408, payload, headers={"Connection": "close"})

    async def _refuse(self, scope: Scope, send: Send, status: int, what: str, size: int | None) -> None:
        if status == 413:
            message = f"{what}; the limit is api.max_body_bytes={self.max_bytes}"
            payload = error_payload("body_too_large", "PayloadTooLarge", message, "body", self.max_bytes)
        else:
            payload = error_payload("bad_request", "BadRequest", what, "Content-Length")
        # the rest of the body was not read: the connection cannot carry another request
        await send_error(scope, send, status, payload, headers={"Connection": "close"})


@dataclass
class _BodyRead:
    """What :meth:`BodyLimitMiddleware._read` has gathered so far (kept when its deadline cuts it short)."""

    chunks: list[bytes] = field(default_factory=list)
    size: int = 0
    """Bytes received (the chunks kept, and one more past ``max_bytes``)."""
    gone: bool = False
    """The client went away."""


class _FleetCollector(Collector):
    """Queue depth and ready workers per configured model, read from Redis at scrape time."""

    def __init__(self, settings: FleetSettings, client: redis.Redis[bytes]) -> None:
        self.settings = settings
        self.client = client

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        up = GaugeMetricFamily("fleet_redis_up", "1 when the gateway reaches Redis.")
        depth = GaugeMetricFamily("fleet_queue_depth", "Requests waiting per model queue.", labels=["model"])
        ready = GaugeMetricFamily("fleet_ready_workers", "Ready workers per model.", labels=["model"])
        canary_depth = GaugeMetricFamily(
            "fleet_canary_queue_depth", "Requests waiting on each model's canary queue.", labels=["model"]
        )
        weight = GaugeMetricFamily(
            "fleet_model_canary_weight", "Percent of a model's traffic routed to its canary (0 = none).",
            labels=["model"],
        )
        rollbacks = CounterMetricFamily(
            "fleet_model_auto_rollbacks", "Canaries rolled back automatically, per model.", labels=["model"]
        )
        dead = CounterMetricFamily(
            "fleet_dead_lettered", "Queue items workers dead-lettered, by reason (fleet dead-letter list shows them).",
            labels=["reason"],
        )
        dead_held = GaugeMetricFamily(
            "fleet_dead_letter_entries", "Entries in the dead-letter list (the newest are kept, up to its cap)."
        )
        try:  # the heartbeat keys' SCAN, then one pipeline for the rest, however many models
            queues = {name: (self.settings.queue_for(name), self.settings.canary_queue_for(name))
                      for name in self.settings.models}  # fmt: skip
            keys = [key.format(model=name) for name in queues for key in (STATE_KEY, AUTO_ROLLBACKS_KEY)]
            with self.client.pipeline(transaction=False) as pipe:
                workers_of = pipe_list_workers(self.client, pipe)
                waiting_of = pipe_waiting_counts(pipe, [q for pair in queues.values() for q in pair])
                if keys:
                    pipe.mget(keys)  # every model's state and auto-rollback counter
                pipe.hgetall(DEAD_LETTER_COUNTS_KEY)
                pipe.llen(DEAD_LETTER_KEY)
                replies = iter(pipe.execute())
            workers, waiting = workers_of(replies), waiting_of(replies)
            raws = iter(next(replies) if keys else [])
            dead_counts, dead_entries = next(replies), next(replies)
            for name, (queue, canary) in queues.items():
                depth.add_metric([name], waiting[queue].requests)  # a bulk message counts its requests
                ready.add_metric([name], sum(1 for w in workers if w.get("model") == name and w.get("ready")))
                canary_depth.add_metric([name], waiting[canary].requests)
                raw_state, raw_rollbacks = next(raws), next(raws)
                state = None if raw_state is None else ModelState.model_validate_json(raw_state)
                weight.add_metric([name], state.canary_weight if state and state.canary else 0)
                rollbacks.add_metric([name], int(raw_rollbacks or 0))
            for reason, count in sorted(dead_counts.items()):
                dead.add_metric([reason.decode(errors="replace")], int(count))
            dead_held.add_metric([], dead_entries)
            up.add_metric([], 1)
        except redis.RedisError:
            up.add_metric([], 0)
        yield up
        yield depth
        yield ready
        yield canary_depth
        yield weight
        yield rollbacks
        yield dead
        yield dead_held


class GatewayMetrics:
    """The gateway's series, in their own registry (one per app)."""

    def __init__(
        self, registry: CollectorRegistry, settings: FleetSettings, client: redis.Redis[bytes],
        prefixes: PrefixRouter | None = None,
    ) -> None:
        """``prefixes``: the submitting client's prefix-aware router, whose counts become
        ``fleet_gateway_prefix_routing_total{result="routed"|"unrouted"}``."""
        self.requests = Counter(
            "fleet_gateway_requests",
            "HTTP requests, by route, method and status.",
            ["route", "method", "status"],
            registry=registry,
        )
        self.latency = Histogram(
            "fleet_gateway_request_duration_seconds",
            "HTTP request latency (s), by route, method, status.",
            ["route", "method", "status"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.refused = Counter(
            "fleet_gateway_admission_refused",
            "Submissions refused by admission control, by reason.",
            ["reason"],
            registry=registry,
        )
        for reason in ("queue_full", "rate_limited"):
            self.refused.labels(reason)  # export zeros, so rate() sees the series from the start
        self.in_progress = 0
        """Requests being answered now, the probes and /metrics aside (kept by :mod:`gateway.concurrency_cap`)."""
        Gauge("fleet_gateway_requests_in_progress", "HTTP requests being answered now (long polls and streams "
              "included; the probes and /metrics not).", registry=registry).set_function(lambda: self.in_progress)
        self.overloaded = Counter(
            "fleet_gateway_overloaded", "Requests answered 503 at api.max_concurrent_requests.", registry=registry
        )
        registry.register(_FleetCollector(settings, client))
        if prefixes is not None:
            registry.register(_RoutingCollector(prefixes))


class _RoutingCollector(Collector):
    """The gateway's prefix-aware routing decisions (:mod:`producer.prefix_routing`), read at scrape time."""

    def __init__(self, prefixes: PrefixRouter) -> None:
        self.prefixes = prefixes

    def collect(self) -> Iterator[CounterMetricFamily]:
        routed = CounterMetricFamily(
            "fleet_gateway_prefix_routing",
            "Generations looked up for prefix-aware routing: sent to the worker holding their prefix (routed) "
            "or to the model's queue (unrouted).",
            labels=["result"],
        )
        routed.add_metric(["routed"], self.prefixes.routed)
        routed.add_metric(["unrouted"], self.prefixes.unrouted)
        yield routed


class MetricsMiddleware:
    """Count and time every HTTP request by route template, method and status."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def capture(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, capture)
        finally:
            route = _route_template(scope)
            labels = (route, str(scope.get("method", "")), str(status))
            self.metrics.requests.labels(*labels).inc()
            self.metrics.latency.labels(*labels).observe(time.perf_counter() - started)


class AccessLogMiddleware:
    """One line per HTTP request on logger ``fleet.access`` (the access log of ``log.format: json``):
    method, path, status, duration (ms), client, and the request ID the call concerns: the response's
    ``X-Request-ID`` (OpenAI routes; embeddings: the IDs, comma-separated), the ID in its ``Location``
    (a native submit), or the route's ``{request_id}``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500
        request_id: str | None = None

        async def capture(message: Message) -> None:
            nonlocal status, request_id
            if message["type"] == "http.response.start":
                status = int(message["status"])
                request_id = _request_id_in(message.get("headers") or [])
            await send(message)

        try:
            await self.app(scope, receive, capture)
        finally:
            request_id = request_id or (scope.get("path_params") or {}).get("request_id")
            method, path = str(scope.get("method", "")), str(scope.get("path", ""))
            query = scope.get("query_string") or b""
            target = f"{path}?{query.decode('latin-1')}" if query else path
            client = scope.get("client")
            peer = f"{client[0]}:{client[1]}" if client else "-"
            took_ms = round((time.perf_counter() - started) * 1000, 3)
            extra = {"method": method, "path": target, "status": status, "client": peer, "duration_ms": took_ms,
                     "request_id": request_id}  # fmt: skip
            version = scope.get("http_version", "1.1")
            access_log.info('%s - "%s %s HTTP/%s" %d', peer, method, target, version, status, extra=extra)


def _request_id_in(headers: Any) -> str | None:
    """The request ID a response names: its X-Request-ID, else the ID at the end of a /v1/requests/ Location."""
    for key, value in headers:
        name = bytes(key).lower()
        if name == b"x-request-id":
            return bytes(value).decode("latin-1")
        if name == b"location" and bytes(value).startswith(b"/v1/requests/"):
            return bytes(value)[len(b"/v1/requests/") :].decode("latin-1")
    return None


def _route_template(scope: Scope) -> str:
    """The route template the request matched (set by the router, or found again for requests refused
    before routing, such as a 413 from the body limit); "unmatched" for paths no route serves."""
    route: Any = scope.get("route")
    if route is not None and hasattr(route, "path"):
        return str(route.path)
    app: Any = scope.get("app")
    return _match_template(getattr(getattr(app, "router", None), "routes", []), scope) or "unmatched"


def _match_template(routes: Any, scope: Scope) -> str | None:
    """Depth-first search of ``routes``: plain routes carry ``path``; included routers (FastAPI wraps
    them, e.g. ``_IncludedRouter``) carry their own routes and are searched in turn."""
    for candidate in routes:
        inner = getattr(getattr(candidate, "original_router", candidate), "routes", None)
        if inner is not None and not hasattr(candidate, "path"):
            found = _match_template(inner, scope)
            if found:
                return found
            continue
        path = getattr(candidate, "path", None)
        if path is None:
            continue
        match, _ = candidate.matches(scope)
        if match is Match.FULL:
            return str(path)
    return None
