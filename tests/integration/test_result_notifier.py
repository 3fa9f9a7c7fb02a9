"""The gateway's result waits woken by the result's publication (:mod:`gateway.result_notifier`), on a
real redis-server and a real Celery result backend: a wait whose backstop reads are pushed past its
timeout still answers (only the publication can have woken it); a result stored without a publication
is still found; many waits share one pub/sub connection and leave no subscription behind."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import redis
import redis.asyncio

from gateway import outcomes
from gateway.app import get_request
from gateway.outcomes import await_outcomes
from gateway.request_owners import RequestOwners
from gateway.result_notifier import ResultNotifier
from producer.client import FleetClient
from producer.presence import marker_key
from protocol.errors import InvalidRequest
from protocol.settings import FleetSettings
from tools.redis_server import EmbeddedRedis


@pytest.fixture
def client(redis_server: EmbeddedRedis) -> Iterator[FleetClient]:
    redis.Redis.from_url(redis_server.url).flushall()
    c = FleetClient(FleetSettings(redis_url=redis_server.url))
    yield c
    c.close()


@contextlib.asynccontextmanager
async def _notifying(url: str) -> AsyncIterator[tuple[redis.asyncio.Redis[bytes], ResultNotifier]]:
    """An asyncio client and a notifier on it, both closed at the end."""
    aredis = redis.asyncio.Redis.from_url(url)
    notifier = ResultNotifier(aredis)
    try:
        yield aredis, notifier
    finally:
        await notifier.aclose()
        await aredis.aclose()  # type: ignore[attr-defined]  # types-redis predates aclose


def _subscribers(url: str, key: bytes) -> int:
    counts: dict[Any, int] = dict(redis.Redis.from_url(url).pubsub_numsub(key))  # types-redis says str keys; bytes here
    return int(counts[key])


async def _until(check: object, what: str) -> None:
    for _ in range(20_000):  # each pass yields to the loop (and to Redis): an event, not a time window
        if await asyncio.to_thread(check):  # type: ignore[arg-type]
            return
    raise AssertionError(f"never: {what}")


def _fail(client: FleetClient, rid: str, *, publish: bool) -> None:
    """Store ``rid``'s failure the way a worker does (SET + PUBLISH), or with SET alone."""
    backend = client.app.backend
    if publish:
        backend.mark_as_failure(rid, InvalidRequest(f"bad {rid}", "input_ids", 1))
        return
    meta = backend._get_result_meta(result=backend.prepare_exception(InvalidRequest(f"bad {rid}", "input_ids", 1)),
                                    state="FAILURE", traceback=None, request=None)  # fmt: skip
    meta["task_id"] = rid
    client.redis.set(backend.get_key_for_task(rid), backend.encode(meta))


def test_a_publication_wakes_every_wait_on_one_connection(client: FleetClient, redis_server: EmbeddedRedis,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setattr(outcomes, "BACKSTOP_POLL_S", (3600.0, 3600.0))  # only a publication can end these waits
    url = redis_server.url

    async def main() -> None:
        async with _notifying(url) as (aredis, notifier):
            key = client.app.backend.get_key_for_task
            waits = [asyncio.create_task(await_outcomes(client, aredis, ids, timeout_s=120, notifier=notifier))
                     for ids in (["a"], ["a", "b"], ["b"], ["c"])]  # fmt: skip
            for rid in "abc":
                await _until(lambda rid=rid: _subscribers(url, key(rid)) == 1, f"{rid} subscribed once")
            for rid in "abc":
                await asyncio.to_thread(_fail, client, rid, publish=True)
            answers = await asyncio.gather(*waits)
            assert [sorted(a) for a in answers] == [["a"], ["a", "b"], ["b"], ["c"]]
            assert all(isinstance(v, InvalidRequest) for a in answers for v in a.values())
            await _until(lambda: all(_subscribers(url, key(r)) == 0 for r in "abc"), "every channel unsubscribed")
            pubsubs = [c for c in redis.Redis.from_url(url).client_list() if int(c.get("sub", 0)) or "subscribe"
                       in c.get("cmd", "")]  # fmt: skip
            assert len(pubsubs) <= 1  # one connection served them all

    asyncio.run(main())


def test_a_result_stored_without_publication_is_still_found(client: FleetClient, redis_server: EmbeddedRedis) -> None:
    async def main() -> None:
        async with _notifying(redis_server.url) as (aredis, notifier):
            key = client.app.backend.get_key_for_task(b"lost".decode())
            wait = asyncio.create_task(await_outcomes(client, aredis, ["lost"], timeout_s=120, notifier=notifier))
            await _until(lambda: _subscribers(redis_server.url, key) == 1, "subscribed")
            await asyncio.to_thread(_fail, client, "lost", publish=False)
            answer = await wait  # by a backstop read
            assert isinstance(answer["lost"], InvalidRequest)

    asyncio.run(main())


def test_a_woken_wait_takes_the_published_value_without_reading_it_again(
    client: FleetClient, redis_server: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker publishes what it stores: a wait woken by the publication answers from it. One MGET per
    wait (the read after subscribing), where a second read of the same value followed every wake-up."""
    monkeypatch.setattr(outcomes, "BACKSTOP_POLL_S", (3600.0, 3600.0))  # no backstop read in this test
    url = redis_server.url

    async def main() -> None:
        async with _notifying(url) as (aredis, notifier):
            key = client.app.backend.get_key_for_task
            mgets_before = _calls(url, "mget")
            waits = [asyncio.create_task(await_outcomes(client, aredis, [rid], timeout_s=120, notifier=notifier))
                     for rid in ("p", "q")]  # fmt: skip
            for rid in "pq":
                await _until(lambda rid=rid: _subscribers(url, key(rid)) == 1, f"{rid} subscribed")
            await _until(lambda: _calls(url, "mget") - mgets_before == 2, "each wait read its key once")
            for rid in "pq":
                await asyncio.to_thread(_fail, client, rid, publish=True)
            answers = await asyncio.gather(*waits)
            assert all(isinstance(a[rid], InvalidRequest) and a[rid].message == f"bad {rid}"
                       for a, rid in zip(answers, "pq", strict=True))  # fmt: skip
            assert _calls(url, "mget") - mgets_before == 2  # no read after the wake-up

    asyncio.run(main())


def _calls(url: str, command: str) -> int:
    stats = redis.Redis.from_url(url).info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


def test_waits_that_end_together_leave_their_channels_in_one_unsubscribe(
    client: FleetClient, redis_server: EmbeddedRedis
) -> None:
    """A wait that ends answers at once: its channels are unsubscribed by the notifier's own task, and the
    channels of the waits that ended in the same turn go in one ``UNSUBSCRIBE`` (before, each wait sent
    its own and waited for it before answering)."""
    url = redis_server.url

    async def main() -> None:
        async with _notifying(url) as (_, notifier):
            keys = [client.app.backend.get_key_for_task(rid) for rid in ("x", "y", "z")]
            before = _calls(url, "unsubscribe")
            async with contextlib.AsyncExitStack() as waits:
                for key in keys:
                    await waits.enter_async_context(notifier.watching([key]))
                for key in keys:
                    await _until(lambda key=key: _subscribers(url, key) == 1, "subscribed")
            await _until(lambda: all(_subscribers(url, k) == 0 for k in keys), "every channel unsubscribed")
            assert _calls(url, "unsubscribe") - before == 1

    asyncio.run(main())


def test_a_channel_wanted_again_before_its_unsubscribe_stays_subscribed(
    client: FleetClient, redis_server: EmbeddedRedis
) -> None:
    """A wait ends and another on the same result starts before the notifier's task has unsubscribed the
    channel: the channel stays subscribed, and the publication wakes the new wait."""
    url = redis_server.url

    async def main() -> None:
        async with _notifying(url) as (_, notifier):
            key = client.app.backend.get_key_for_task("again")
            async with notifier.watching([key]):
                await _until(lambda: _subscribers(url, key) == 1, "subscribed")
            async with notifier.watching([key]) as watch:  # in the same turn: the unsubscribe is not sent yet
                for _ in range(50):  # let the notifier's task run its turns
                    await asyncio.sleep(0)
                assert _subscribers(url, key) == 1
                await asyncio.to_thread(_fail, client, "again", publish=True)
                await asyncio.wait_for(watch.event.wait(), 60)
                assert key in watch.published
            await _until(lambda: _subscribers(url, key) == 0, "unsubscribed once no wait needs it")

    asyncio.run(main())


def test_a_long_poll_reads_the_result_once_and_takes_it_from_the_publication(
    client: FleetClient, redis_server: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``GET /v1/requests/{id}?wait_s=`` (the route's function, on real Redis and a real notifier): the
    result's channel is subscribed before the request's view is read, so the view's read is the wait's
    first and the answer comes from the publication. Before, the view was read, then the channel
    subscribed and the result read again with an ``MGET``."""
    monkeypatch.setattr(outcomes, "BACKSTOP_POLL_S", (3600.0, 3600.0))  # only a publication can end the wait
    url = redis_server.url
    client.redis.set(marker_key("polled"), b"{}")  # submitted, not started: queued

    async def main() -> None:
        async with _notifying(url) as (aredis, notifier):
            owners = RequestOwners(client.redis, [], client.settings.result_ttl_s)  # auth off: no marks
            gw = SimpleNamespace(settings=client.settings, fleet=client, aredis=aredis, results=notifier, owners=owners)
            mgets_before = _calls(url, "mget")
            poll = asyncio.create_task(get_request("polled", None, gw, wait_s=60.0))  # type: ignore[arg-type]
            key = client.app.backend.get_key_for_task("polled")
            await _until(lambda: _subscribers(url, key) == 1, "subscribed")
            await asyncio.to_thread(_fail, client, "polled", publish=True)
            response = await asyncio.wait_for(poll, 60)
            doc = json.loads(bytes(response.body))
            assert doc["status"] == "failed" and doc["error"]["message"] == "bad polled", doc
            assert _calls(url, "mget") - mgets_before == 0

    asyncio.run(main())
