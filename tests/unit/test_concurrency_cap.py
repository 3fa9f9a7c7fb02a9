"""The gateway's bound on requests answered at once (:mod:`gateway.concurrency_cap`), as pure ASGI: requests
held open by an app that answers only when told, one more refused 503 at once naming the setting and the limit
with Retry-After, the probes and /metrics never refused, and the count back to 0 once they end."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from gateway.concurrency_cap import ConcurrencyCapMiddleware


class _Counts:
    """What the middleware keeps on the gateway's metrics: the count and the refusals."""

    def __init__(self) -> None:
        self.in_progress = 0
        self.refused = 0
        self.overloaded = self

    def inc(self) -> None:
        self.refused += 1


def test_one_request_past_the_cap_is_refused_and_the_probes_pass() -> None:
    release = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["path"] == "/v1/requests/x":
            await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    counts = _Counts()
    cap = ConcurrencyCapMiddleware(app, 2, counts)  # type: ignore[arg-type]

    async def call(path: str) -> tuple[int, dict[bytes, bytes], bytes]:
        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        await cap({"type": "http", "path": path, "headers": []}, receive, send)
        return sent[0]["status"], dict(sent[0]["headers"]), sent[1]["body"]

    async def run() -> None:
        held = [asyncio.create_task(call("/v1/requests/x")) for _ in range(2)]
        while counts.in_progress < 2:
            await asyncio.sleep(0)
        status, headers, body = await call("/v1/requests/x")
        assert status == 503 and headers[b"retry-after"] == b"1"
        payload = json.loads(body)
        assert (payload["error"], payload["field"], payload["limit"]) == (
            "overloaded", "api.max_concurrent_requests", 2)
        for probe in ("/healthz", "/health", "/readyz", "/metrics"):
            assert (await call(probe))[0] == 200, probe
        openai_status, _, openai_body = await call("/v1/models")
        assert openai_status == 503 and json.loads(openai_body)["error"]["param"] == "api.max_concurrent_requests"
        release.set()
        assert [(await t)[0] for t in held] == [200, 200]
        assert counts.in_progress == 0 and counts.refused == 2
        assert (await call("/v1/requests/x"))[0] == 200  # served again once they ended

    asyncio.run(run())
