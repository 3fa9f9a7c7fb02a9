"""Footprints of long-lived fleet processes and of Redis, and a round of mixed traffic, for the leak tests
(tests/integration/test_leaks_traffic.py).

:func:`process_footprint` reads a process's open file descriptors, threads and RSS (psutil, children
included); :func:`redis_footprint` reads Redis's connected clients, pub/sub channels and its keys by
prefix (SCAN), with every key that has no TTL. :func:`traffic_round` sends one round of the mix the
gateway serves (one-step, bulk, generations streamed or not, cancelled mid-stream, SSE clients cut
abruptly, long-polls that time out, OpenAI SDK calls, refused requests) and waits for every request it
queued to finish, so a footprint read afterwards sees only what the traffic left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import struct
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import psutil
import redis

__all__ = [
    "PERMANENT_KEYS",
    "UNIT_REQUESTS",
    "ProcessFootprint",
    "RedisFootprint",
    "Tally",
    "fd_kinds",
    "key_family",
    "process_footprint",
    "redis_footprint",
    "traffic_round",
]

PERMANENT_KEYS = re.compile(
    rb"^(_kombu\.binding.*|fleet:model:[^:]+:card|fleet:dead-letter(:counts)?|fleet:live:[^:]+|fleet:direct:[^:]+"
    rb"|fleet\.[^:]+)$"
)
"""Keys that live without a TTL by design: kombu's bindings, model cards, the dead-letter list and its
counts, each model's live-worker set and direct-queue registry, and the queues (lists named
``fleet.<model>``, there while something waits in them)."""

_ID_SEGMENT = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-|[0-9a-f]{32}|lk-[0-9a-z-]+")


def key_family(key: bytes) -> str:
    """A key's family: ``celery-task-meta-*`` and ``fleet:<kind>:*`` (per-request IDs folded into ``*``)."""
    if key.startswith(b"celery-task-meta-"):
        return "celery-task-meta-*"
    if key.startswith(b"fleet:"):
        parts = key.split(b":")
        return ":".join(p.decode(errors="replace") if i < 2 and not _ID_SEGMENT.match(p) else "*"
                        for i, p in enumerate(parts[:3]))
    return key.split(b".")[0].decode(errors="replace") + ".*"


@dataclass(frozen=True)
class ProcessFootprint:
    fds: int
    threads: int
    rss_mib: float


def process_footprint(pid: int) -> ProcessFootprint:
    """Open fds, threads and RSS of ``pid`` and its children (a celery worker's, say)."""
    root = psutil.Process(pid)
    procs = [root, *root.children(recursive=True)]
    fds = threads = rss = 0
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            fds += p.num_fds()
            threads += p.num_threads()
            rss += p.memory_info().rss
    return ProcessFootprint(fds, threads, round(rss / 2**20, 1))


def fd_kinds(pid: int) -> dict[str, int]:
    """What ``pid``'s open fds are: TCP sockets by state and peer port, and the rest by what they point at
    (``pipe``, ``anon_inode:[eventfd]``, a file's suffix...), for a failure's message."""
    kinds: Counter[str] = Counter()
    proc = psutil.Process(pid)
    tcp = {c.fd: c for c in proc.net_connections("tcp")}
    for fd in (proc.num_fds() and sorted(int(n) for n in os.listdir(f"/proc/{pid}/fd"))) or []:
        with contextlib.suppress(OSError):
            if fd in tcp:
                c = tcp[fd]
                kinds[f"tcp {c.status} ->{c.raddr.port if c.raddr else '-'}"] += 1
                continue
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            kinds[re.sub(r"\[\d+\]$|^/.*(?=\.[^./]+$)", "", target)] += 1
    return dict(kinds)


@dataclass(frozen=True)
class RedisFootprint:
    clients: int
    channels: tuple[bytes, ...]
    patterns: int
    families: dict[str, int]
    no_ttl: tuple[bytes, ...]
    """Keys without a TTL that :data:`PERMANENT_KEYS` does not name."""


def redis_footprint(r: redis.Redis[bytes]) -> RedisFootprint:
    """What Redis holds: connected clients (this one included), subscribed channels, keys by family."""
    families: Counter[str] = Counter()
    no_ttl = []
    for key in r.scan_iter(count=1000):
        families[key_family(key)] += 1
        if not PERMANENT_KEYS.match(key) and r.ttl(key) == -1:
            no_ttl.append(key)
    return RedisFootprint(
        clients=int(r.info("clients")["connected_clients"]),
        channels=tuple(sorted(r.pubsub_channels())),
        patterns=int(r.pubsub_numpat()),
        families=dict(families),
        no_ttl=tuple(sorted(no_ttl)),
    )


@dataclass
class Tally:
    """What a round sent: requests by kind, and the IDs the gateway queued (waited on at the round's end)."""

    sent: Counter[str] = field(default_factory=Counter)
    queued: list[str] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return sum(self.sent.values())


def _gen(text: str, max_new_tokens: int) -> dict[str, Any]:
    return {"model": "demo-lm", "text": text,
            "output": {"kind": "generate", "generation": {"max_new_tokens": max_new_tokens, "ignore_eos": True}}}


async def _post(http: httpx.AsyncClient, body: dict[str, Any], tally: Tally, params: Any = None) -> dict[str, Any]:
    resp = await http.post("/v1/requests", json=body, params=params)
    assert resp.status_code in (200, 202), resp.text
    doc: dict[str, Any] = resp.json()
    tally.queued.append(doc["request_id"])
    return doc


async def _first_data(lines: Any) -> None:
    async for line in lines:
        if line.startswith("data:"):
            return


async def _one_step(http: httpx.AsyncClient, tally: Tally, i: int) -> None:
    await _post(http, {"model": "demo-lm", "text": f"one step {i}"}, tally, {"wait_s": 30})
    tally.sent["one-step"] += 1


async def _bulk(http: httpx.AsyncClient, tally: Tally, i: int) -> None:
    items = [{"model": "demo-lm", "input_ids": [5, 6, 7 + i % 50]}, {"model": "demo-lm", "text": f"bulk {i}"},
             {"model": "demo-encoder", "text": f"bulk {i}"}, {"model": "demo-encoder", "input_ids": [9, 9, i % 50]}]
    resp = await http.post("/v1/requests:batch", json={"requests": items})
    assert resp.status_code == 202, resp.text
    tally.queued += [doc["request_id"] for doc in resp.json()["requests"]]
    tally.sent["bulk"] += len(items)


async def _generation_waited(http: httpx.AsyncClient, tally: Tally, i: int) -> None:
    await _post(http, _gen(f"waited {i}", 6), tally, {"wait_s": 30})
    tally.sent["generation"] += 1


async def _generation_streamed(http: httpx.AsyncClient, tally: Tally, i: int, *, cancel: bool) -> None:
    doc = await _post(http, _gen(f"streamed {i}", 48 if cancel else 6), tally)
    rid = doc["request_id"]
    async with http.stream("GET", f"/v1/requests/{rid}/stream", timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.aiter_lines()
        if cancel:
            await _first_data(lines)
            assert (await http.delete(f"/v1/requests/{rid}")).status_code in (200, 409)
        async for _ in lines:  # to the stream's end (final or error)
            pass
    tally.sent["stream-cancelled" if cancel else "stream"] += 1


async def _sse_cut(port: int, api_key: str, http: httpx.AsyncClient, tally: Tally, i: int) -> None:
    """A stream reader that vanishes after its first event: the socket closed with a reset (SO_LINGER 0)."""
    rid = (await _post(http, _gen(f"cut {i}", 48), tally))["request_id"]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET /v1/requests/{rid}/stream HTTP/1.1\r\nHost: x\r\nX-API-Key: {api_key}\r\n\r\n".encode())
    await writer.drain()
    while b"data:" not in await reader.readline():
        pass
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
    tally.sent["sse-cut"] += 1


async def _long_poll_timeout(http: httpx.AsyncClient, tally: Tally, i: int) -> None:
    rid = (await _post(http, _gen(f"long-poll {i}", 48), tally))["request_id"]
    resp = await http.get(f"/v1/requests/{rid}", params={"wait_s": 0.05})
    assert resp.status_code == 200, resp.text
    await http.delete(f"/v1/requests/{rid}")
    tally.sent["long-poll"] += 1


async def _sdk(sdk: openai.AsyncOpenAI, tally: Tally, i: int) -> None:
    done = await sdk.completions.create(model="demo-lm", prompt=f"sdk {i}", max_tokens=4)
    assert done.choices
    emb = await sdk.embeddings.create(model="demo-encoder", input=[f"sdk {i}", "two"])
    assert len(emb.data) == 2
    stream = await sdk.chat.completions.create(model="demo-lm", messages=[{"role": "user", "content": f"hi {i}"}],
                                               max_tokens=6, stream=True)
    async for _ in stream:
        pass
    cut = await sdk.chat.completions.create(model="demo-lm", messages=[{"role": "user", "content": f"cut {i}"}],
                                            max_tokens=48, stream=True, extra_body={"ignore_eos": True})
    async for _ in cut:
        break  # the SDK's reader leaves after its first chunk
    await cut.close()
    tally.sent["openai"] += 5  # the embeddings call is two requests


async def _refused(http: httpx.AsyncClient, sdk: openai.AsyncOpenAI, tally: Tally, i: int) -> None:
    too_long = await http.post("/v1/requests", json={"model": "demo-lm", "input_ids": [5] * 500})
    assert too_long.status_code in (413, 422), too_long.text
    unknown = await http.post("/v1/requests", json={"model": f"no-such-{i % 3}", "input_ids": [5]})
    assert unknown.status_code in (404, 422), unknown.text
    with contextlib.suppress(openai.NotFoundError, openai.BadRequestError, openai.UnprocessableEntityError):
        await sdk.completions.create(model="no-such-model", prompt="x", max_tokens=2)
        raise AssertionError("an unknown model was served")
    tally.sent["refused"] += 3


UNIT_REQUESTS = 21
"""Requests in one unit of the mix (:func:`_unit`)."""


async def _unit(http: httpx.AsyncClient, sdk: openai.AsyncOpenAI, port: int, api_key: str, tally: Tally,
                i: int) -> None:  # fmt: skip
    """One unit of the mix: :data:`UNIT_REQUESTS` requests of every kind, sent together."""
    await asyncio.gather(
        *[_one_step(http, tally, i * 4 + j) for j in range(4)],
        _bulk(http, tally, i),
        _generation_waited(http, tally, i),
        _generation_streamed(http, tally, i, cancel=False),
        _generation_streamed(http, tally, i, cancel=True),
        _sse_cut(port, api_key, http, tally, i),
        _long_poll_timeout(http, tally, i),
        _sdk(sdk, tally, i),
        _refused(http, sdk, tally, i),
    )


async def _traffic(base_url: str, api_key: str, requests: int, parallel: int) -> Tally:
    tally = Tally()
    port = httpx.URL(base_url).port or 80
    limits = httpx.Limits(max_connections=4 * parallel, max_keepalive_connections=4 * parallel)
    async with (
        httpx.AsyncClient(base_url=base_url, headers={"X-API-Key": api_key}, timeout=60, limits=limits) as http,
        openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=60) as sdk,
    ):
        gate = asyncio.Semaphore(parallel)

        async def one(i: int) -> None:
            async with gate:
                await _unit(http, sdk, port, api_key, tally, i)

        await asyncio.gather(*[one(i) for i in range(-(-requests // UNIT_REQUESTS))])
        # every request the round queued ends (a cancelled generation too) before the round does
        for rid in tally.queued:
            doc = (await http.get(f"/v1/requests/{rid}", params={"wait_s": 30})).json()
            assert doc["status"] not in ("queued", "running"), doc
    return tally


def traffic_round(base_url: str, api_key: str, requests: int, parallel: int = 3) -> Tally:
    """About ``requests`` requests of the mix through the gateway at ``base_url``, ``parallel`` units at a
    time; returns once every request it queued has finished."""
    return asyncio.run(_traffic(base_url, api_key, requests, parallel))
