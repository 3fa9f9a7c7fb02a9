"""The Celery floor measured for real: a stock ``celery worker`` of ``floor.echo`` on a private Redis.

A smoke run, not a speed test: every process spent CPU, the request's Redis round trips show up per
request (the message, the result's ``PUBLISH``), the producer used kombu's own channel even with
kombu's Redis transport patched in this process (as ``make_celery`` does), and the worker subprocess
is gone afterwards. Never asserts speed.
"""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest
from kombu.transport import redis as kombu_redis

from bench import celery_floor
from bench.celery_floor import measure_floor
from tools.calibration import synthetic_sequences
from tools.redis_server import EmbeddedRedis


@pytest.mark.timeout(60)
def test_floor_meters_a_stock_worker_and_stops_it(
    redis_server: EmbeddedRedis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert redis_server.proc is not None
    started: list[celery_floor.FloorWorker] = []
    real_start = celery_floor.FloorWorker.start

    def recording_start(self: celery_floor.FloorWorker) -> celery_floor.FloorWorker:
        started.append(self)
        return real_start(self)

    monkeypatch.setattr(celery_floor.FloorWorker, "start", recording_start)

    class PatchedChannel(kombu_redis.Channel):
        """Stands in for the fleet's channel, which make_celery installs process wide."""

    monkeypatch.setattr(kombu_redis.Transport, "Channel", PatchedChannel)
    prompts = synthetic_sequences(32, vocab_size=1000, min_tokens=8, max_tokens=16, seed=101)

    out = measure_floor(redis_server.url, redis_server.proc.pid, tmp_path, prompts, clients=4, duration_s=1.5,
                        rounds=1, events=True, lone_requests=5)  # fmt: skip

    assert out["events"] is True
    assert out["summary"]["requests"] > 0 and out["summary"]["errors"] == 0
    assert 0 < out["summary"]["p50_ms"] <= out["summary"]["p99_ms"]
    assert set(out["cpu_ms_per_request"]) == {"producer", "redis", "worker"}
    assert all(ms > 0 for ms in out["cpu_ms_per_request"].values()), out["cpu_ms_per_request"]
    calls = out["redis_calls_per_request"]
    assert calls.get("lpush", 0) >= 1 and calls.get("brpop", 0) > 0, calls  # one message per request
    assert calls.get("publish", 0) >= 1, calls  # the result's announcement, and the task events
    assert "info" not in calls
    assert out["channel"] == "kombu.transport.redis.Channel"  # stock kombu despite the patched transport
    assert out["lone_p50_ms"] > 0

    assert len(started) == 1
    worker = started[0]
    assert worker.proc is not None and worker.proc.returncode is not None
    assert not psutil.pid_exists(worker.pid)
