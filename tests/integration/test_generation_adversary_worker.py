"""A generation cancelled while it waits in a worker behind a full batch, through a real ``celery worker``, real
Redis and a real ONNX decoder: it ends cancelled at once (its stream ends, its slot is freed) while the
generation ahead of it keeps running; then that one is cancelled too, and the ledger closes: one terminal state
each, stored results that do not change, usage equal to the tokens, and the heartbeat's ``generating`` and
``in_flight`` back to 0. Before, the waiting one stayed held (and counted as generating) until the running
generation ended by itself."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import redis

from producer.client import RequestStatus
from protocol.errors import RequestCancelled
from protocol.keys import WORKER_KEY_PREFIX
from protocol.messages import InferenceResult
from tests.integration.fleet_fixtures import Fleet
from tools.build_llama import build_llama
from tools.processes import poll_until

ENDLESS_TOKENS = 20_000
"""What the running generation asks for: it runs until it is cancelled."""


@pytest.fixture(scope="module")
def endless_decoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small demo Llama with room for :data:`ENDLESS_TOKENS` after a short prompt."""
    return build_llama(tmp_path_factory.mktemp("endless"), max_positions=ENDLESS_TOKENS + 64)


def _heartbeat(r: redis.Redis[bytes], hostname: str) -> dict[str, Any] | None:
    raw = r.get(WORKER_KEY_PREFIX + hostname)
    return json.loads(raw) if raw else None


def test_a_generation_cancelled_behind_a_full_batch_ends_while_the_batch_runs(
    fleet: Fleet, endless_decoder: Path
) -> None:
    cfg = fleet.config(models={"demo-lm": {"path": str(endless_decoder), "batching": {"max_batch_size": 1},
                                           "limits": {"max_new_tokens": ENDLESS_TOKENS}}})  # fmt: skip
    worker = fleet.worker(cfg, concurrency=3)
    client = fleet.client(cfg)
    r = redis.Redis.from_url(fleet.redis_url)
    running = client.submit("demo-lm", [5, 6, 7], generation={"max_new_tokens": ENDLESS_TOKENS, "ignore_eos": True,
                                                               "temperature": 0.9, "seed": 3})  # fmt: skip
    for event in client.stream(running, timeout_s=60):
        if event.index >= 1:
            break
    waiting = client.submit("demo-lm", [8, 9], generation={"max_new_tokens": 4, "ignore_eos": True})
    poll_until(lambda: (doc := _heartbeat(r, worker.hostname)) is not None and doc["generating"] == 2, 60,
               "the second generation waiting in the worker")  # fmt: skip
    assert client.cancel(waiting)
    (outcome,) = client.wait([waiting], timeout_s=60)
    assert isinstance(outcome, RequestCancelled), outcome
    events = list(client.stream(waiting, timeout_s=30))
    assert events and events[-1].is_last and events[-1].type == "error", events
    assert client.status(running) is RequestStatus.RUNNING  # the batch ahead of it runs on, untouched

    assert client.cancel(running, settle_s=60)
    result = client.result(running, wait=True, timeout_s=60)
    assert isinstance(result, InferenceResult) and result.generation is not None
    gen = result.generation
    assert gen.finish_reason == "cancelled" and 1 <= len(gen.token_ids) < ENDLESS_TOKENS
    assert gen.usage.prompt_tokens == 3 and gen.usage.completion_tokens == len(gen.token_ids)
    streamed = list(client.stream(running, timeout_s=30))
    assert [e.token_id for e in streamed if e.type == "token"] == gen.token_ids
    assert streamed[-1].usage == gen.usage

    poll_until(lambda: (doc := _heartbeat(r, worker.hostname)) is not None and doc["generating"] == 0
               and doc["in_flight"] == 0, 60, "the worker to hold nothing")  # fmt: skip
    assert client.status(waiting) is RequestStatus.CANCELLED and client.status(running) is RequestStatus.SUCCEEDED
    again = client.result(running, wait=True, timeout_s=5)
    assert again is not None and again.model_dump() == result.model_dump()  # the stored result never changes
