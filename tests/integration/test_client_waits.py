"""``FleetClient.wait``, ``result`` and ``stream`` against a real redis-server and real workers: a Redis restart
in the middle of a wait, and the time limits (None and ``inf`` mean none, as for ``result``)."""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

import pytest

from producer.client import FleetClient
from protocol.errors import FleetError, InvalidRequest, ResultTimeout
from protocol.messages import InferenceResult
from tests.integration.fleet_fixtures import Fleet
from tools.redis_server import EmbeddedRedis


def test_wait_rides_out_a_redis_restart(tmp_path: Path, model_dir: Path) -> None:
    """Redis (AOF) is killed while wait() polls and started again: wait() goes on and returns the results a
    worker started afterwards computes. Before, the first MGET that failed raised redis.ConnectionError at once,
    while result(wait=True) and stream() rode the same outage out."""
    (tmp_path / "redis").mkdir()
    server = EmbeddedRedis(appendonly=True, data_dir=tmp_path / "redis").start()
    fleet = Fleet(tmp_path, model_dir, server.url)
    try:
        cfg = fleet.config()
        client = fleet.client(cfg)
        ids = [client.submit("demo-lm", [5, 6, i + 7]) for i in range(3)]  # no worker yet: they wait
        polled, failed = threading.Event(), threading.Event()
        finished = client._finished

        def noting(request_ids: Any) -> Any:
            polled.set()
            try:
                return finished(request_ids)
            except Exception:
                failed.set()
                raise

        client._finished = noting  # type: ignore[method-assign]
        outcome: dict[str, Any] = {}

        def waiting() -> None:
            try:
                outcome["results"] = client.wait(ids, timeout_s=60)
            except Exception as exc:  # what the test reports
                outcome["error"] = exc

        waiter = threading.Thread(target=waiting, daemon=True)
        waiter.start()
        assert polled.wait(30)
        server.kill()
        assert failed.wait(30), "wait() never asked Redis while it was down"
        server.start()  # same port, same AOF: the queued requests are still there
        assert server.client().llen("fleet.demo-lm") == 3
        worker = fleet.worker(cfg)
        waiter.join(90)
        assert not waiter.is_alive()
        assert "error" not in outcome, repr(outcome.get("error"))
        results = outcome["results"]
        assert all(isinstance(r, InferenceResult) for r in results), (results, worker.log_tail())
    finally:
        fleet.close()
        server.stop()


def test_no_limit_is_none_or_inf_everywhere_and_ids_are_read_once(fleet: Fleet) -> None:
    cfg = fleet.config()
    fleet.worker(cfg)
    client: FleetClient = fleet.client(cfg)
    ids = [client.submit("demo-lm", [5, 6, i]) for i in range(3)]
    assert all(isinstance(r, InferenceResult) for r in client.wait(ids, timeout_s=None))  # was a TypeError
    assert all(isinstance(r, InferenceResult) for r in client.wait(ids, timeout_s=math.inf))
    assert all(isinstance(r, InferenceResult) for r in client.wait(iter(ids)))  # a generator: was []
    assert [r.request_id for r in client.wait(rid for rid in ids) if isinstance(r, InferenceResult)] == ids
    assert client.result(ids[0], wait=True, timeout_s=math.inf) is not None
    gen = client.submit("demo-lm", text="Hi", generation={"max_new_tokens": 3})
    events = list(client.stream(gen, timeout_s=math.inf))  # was an OverflowError in block_for_ms
    assert events[-1].type == "final"
    assert list(client.stream(gen, timeout_s=None))[-1].type == "final"
    never = client.wait(["never-submitted"], timeout_s=0)
    assert isinstance(never[0], ResultTimeout)


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda c: c.wait(["never-submitted"], timeout_s=math.nan), "timeout_s"),  # was: blocked forever
        (lambda c: c.result("never-submitted", wait=True, timeout_s=math.nan), "timeout_s"),  # the same
        (lambda c: c.wait(["never-submitted"], timeout_s=-1), "timeout_s"),
        (lambda c: c.wait(["never-submitted"], poll_s=-1), "poll_s"),  # was a raw ValueError from time.sleep
        (lambda c: c.stream("never-submitted", timeout_s=0), "timeout_s"),  # was a raw ValueError
    ],
)
def test_a_bad_time_limit_is_an_invalid_request(fleet: Fleet, call: Any, field: str) -> None:
    client = fleet.client(fleet.config())
    with pytest.raises(InvalidRequest) as info:
        call(client)
    assert info.value.field == field
    assert isinstance(info.value, FleetError)
