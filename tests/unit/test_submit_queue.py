"""The gateway's group commit (:class:`gateway.submit_queue.SubmitQueue`), with a stand-in for the
Redis step: what waits while a send is in flight is the next group, a lone caller is sent at once,
an item is never split, and each caller gets its own outcome."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import pytest
from prometheus_client import CollectorRegistry

from gateway.submit_queue import SubmitQueue
from producer.submit_groups import SubmitItem
from protocol.errors import QueueFull
from protocol.messages import InferenceRequest


def _item(tag: int, count: int = 1) -> SubmitItem:
    return SubmitItem([InferenceRequest(model="m", input_ids=[tag, i + 1], request_id=f"r{tag}-{i}")
                       for i in range(count)])  # fmt: skip


class _Sender:
    """Records each group; the first send waits for ``release`` (set from the test) so others queue up."""

    def __init__(self, refuse: set[str] | None = None) -> None:
        self.groups: list[list[str]] = []
        self.release = threading.Event()
        self.entered = threading.Event()
        self.refuse = refuse or set()

    def __call__(self, items: Sequence[SubmitItem]) -> list[list[str] | BaseException]:
        self.groups.append([str(it.requests[0].request_id) for it in items])
        self.entered.set()
        if len(self.groups) == 1:
            assert self.release.wait(30)
        return [QueueFull("full", "max_queue_depth", 1, 1.0) if str(it.requests[0].request_id) in self.refuse
                else [str(r.request_id) for r in it.requests] for it in items]  # fmt: skip


async def _waiting(queue: SubmitQueue, count: int) -> None:
    while len(queue._waiting) < count:  # the test's own event: the callers have queued
        await asyncio.sleep(0)


def test_what_arrives_during_a_send_is_the_next_group_and_each_caller_gets_its_own_ids() -> None:
    async def main() -> None:
        sender = _Sender(refuse={"r3-0"})
        registry = CollectorRegistry()
        queue = SubmitQueue(sender, max_group_requests=4, registry=registry)
        first = asyncio.create_task(queue.submit(_item(0)))
        await asyncio.to_thread(sender.entered.wait, 30)  # the lone caller went at once, alone
        later = [asyncio.create_task(queue.submit(_item(i, 2 if i == 2 else 1))) for i in range(1, 6)]
        await _waiting(queue, 5)
        sender.release.set()
        assert await first == ["r0-0"]
        outcomes = await asyncio.gather(*later, return_exceptions=True)
        assert outcomes[0] == ["r1-0"] and outcomes[1] == ["r2-0", "r2-1"] and outcomes[3] == ["r4-0"]
        assert isinstance(outcomes[2], QueueFull)  # refused alone; its group's others went
        assert outcomes[4] == ["r5-0"]
        # max 4 requests a group: items 1, 2 (two requests), 3 | then 4, 5; item 2 never split
        assert sender.groups == [["r0-0"], ["r1-0", "r2-0", "r3-0"], ["r4-0", "r5-0"]]
        assert registry.get_sample_value("fleet_gateway_submit_groups_total") == 3
        assert registry.get_sample_value("fleet_gateway_grouped_requests_total") == 6

    asyncio.run(main())


def test_a_caller_that_leaves_does_not_stop_the_others() -> None:
    async def main() -> None:
        sender = _Sender()
        queue = SubmitQueue(sender, max_group_requests=64, registry=CollectorRegistry())
        first = asyncio.create_task(queue.submit(_item(0)))
        await asyncio.to_thread(sender.entered.wait, 30)
        leaving = asyncio.create_task(queue.submit(_item(1)))
        staying = asyncio.create_task(queue.submit(_item(2)))
        await _waiting(queue, 2)
        leaving.cancel()
        sender.release.set()
        assert await first == ["r0-0"] and await staying == ["r2-0"]
        with pytest.raises(asyncio.CancelledError):
            await leaving
        assert sender.groups[1] == ["r1-0", "r2-0"]  # its request was queued all the same (as a thread's was)

    asyncio.run(main())


def test_a_failing_send_reaches_every_caller_of_its_group() -> None:
    def broken(items: Sequence[SubmitItem]) -> list[list[str] | BaseException]:
        raise RuntimeError("boom")

    async def main() -> None:
        queue = SubmitQueue(broken, max_group_requests=8, registry=CollectorRegistry())
        outcomes = await asyncio.gather(queue.submit(_item(0)), queue.submit(_item(1)), return_exceptions=True)
        assert all(isinstance(o, RuntimeError) for o in outcomes)
        later = await asyncio.gather(queue.submit(_item(2)), return_exceptions=True)  # a new flusher answers it
        assert isinstance(later[0], RuntimeError)

    asyncio.run(main())
