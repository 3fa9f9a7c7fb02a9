"""A bound on the requests one gateway process answers at once (``api.max_concurrent_requests``).

Each request being answered holds a client socket, and a long-poll or a stream holds it for as long as it
waits (up to ``api.max_wait_s``, or a whole generation). Past the process's open-file limit the gateway
can accept no connection and open no Redis connection: every caller then fails, health probes included.
:class:`ConcurrencyCapMiddleware` answers the request past the bound ``503`` at once, in the gateway's
error shape (OpenAI's on its routes) naming ``api.max_concurrent_requests`` and the limit, with
``Retry-After: 1``, so a load balancer sends it to another replica and a client retries (with
``Connection: close`` when it carries a body, which is not read). The probes and ``/metrics`` are never
refused (an overloaded replica must not look dead to a liveness probe).

A request is counted from its head, before its body is read: a body that never ends would hold its slot, so
reading one is bounded in time (``api.body_timeout_s``, :class:`gateway.middleware.BodyLimitMiddleware`: ``408``
and the connection closed).

The bound is counted by this process alone (per replica); 0 derives it from the open-file limit
(:func:`default_limit`).
"""

from __future__ import annotations

import resource

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.body_guard import has_body, send_error
from gateway.errors import error_payload
from gateway.middleware import GatewayMetrics

__all__ = ["ConcurrencyCapMiddleware", "default_limit"]

NEVER_REFUSED = frozenset({"/healthz", "/health", "/readyz", "/metrics"})
"""Paths answered whatever the load: the probes and the metrics scrape."""


def default_limit() -> int:
    """Three quarters of the process's soft open-file limit (at least 64): a request holds one socket, and the
    rest is left for Redis connections, the probes and the log files."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(64, soft * 3 // 4) if soft != resource.RLIM_INFINITY else 1 << 20


class ConcurrencyCapMiddleware:
    """Answer ``503`` to an HTTP request that arrives while ``limit`` others are being answered (see the module)."""

    def __init__(self, app: ASGIApp, limit: int, metrics: GatewayMetrics) -> None:
        self.app = app
        self.limit = limit or default_limit()
        self.metrics = metrics
        """Keeps the count (``in_progress``: the probes and /metrics not counted) and the refusals."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in NEVER_REFUSED:
            await self.app(scope, receive, send)
            return
        metrics = self.metrics
        if metrics.in_progress >= self.limit:
            metrics.overloaded.inc()
            message = (f"the gateway is answering {metrics.in_progress} requests, its limit (api.max_concurrent_"
                       f"requests={self.limit}); retry, or send to another replica")  # fmt: skip
            payload = error_payload("overloaded", "Overloaded", message, "api.max_concurrent_requests", self.limit)
            # a body left unread would keep the connection (uvicorn reads it on and drops it, with no timer): closed
            headers = {"Retry-After": "1", **({"Connection": "close"} if has_body(scope) else {})}
            await send_error(scope, send, 503, payload, headers=headers)
            return
        metrics.in_progress += 1
        try:
            await self.app(scope, receive, send)
        finally:
            metrics.in_progress -= 1
