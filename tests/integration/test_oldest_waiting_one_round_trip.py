"""``fleet status`` reads every model's oldest waiting request in one round trip, whatever the number of models.

Before, :func:`producer.registry.read_fleet_state` ran one pipeline of ``LINDEX`` per model: with 5 models, 5
round trips for the OLDEST WAITING column. Now one pipeline reads every queue's tails
(:func:`producer.registry.oldest_waiting_ages_s`), with the same ages.

Real redis-server; the messages are real kombu messages sent by a plain Celery app (one with a priority, in
kombu's sibling list); round trips are counted by a redis-py connection that records each write to its socket.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import redis
from celery import Celery

from producer.registry import oldest_waiting_age_s, read_fleet_state
from protocol.settings import load_settings
from tools.redis_server import EmbeddedRedis

MODELS = [f"model-{i}" for i in range(5)]
NOW_S = 1_900_000_000.0
"""The status's clock (unix s): each request's stamp is set against it."""


class CountingConnection(redis.Connection):
    """A real connection that records the Redis commands of each write to its socket (one per round trip)."""

    writes: ClassVar[list[bytes]] = []

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        packed = command if isinstance(command, bytes | str) else b"".join(map(bytes, command))
        self.writes.append(packed.encode() if isinstance(packed, str) else packed)
        super().send_packed_command(command, check_health)


def test_five_models_oldest_ages_in_one_round_trip(redis_server: EmbeddedRedis, tmp_path: Path) -> None:
    settings = load_settings("/dev/null", redis_url=redis_server.url,
                             models={m: {"path": str(tmp_path / f"{m}.onnx")} for m in MODELS})  # fmt: skip
    app = Celery("plain", broker=redis_server.url)
    app.conf.update(task_serializer="json", accept_content=["json"], broker_connection_retry_on_startup=False)
    expected: dict[str, float | None] = {}
    try:
        for i, model in enumerate(MODELS[:-1]):  # the last model's queue stays empty
            oldest = NOW_S - 100.0 * (i + 1)
            for stamp, priority in ((oldest, 9 if i % 2 else None), (oldest + 5.0, None)):  # sent in age order
                app.send_task("fleet.infer", args=[{"model": model, "input_ids": [5, 6], "submitted_at_unix_s": stamp}],
                              queue=settings.queue_for(model), priority=priority)  # fmt: skip
            expected[settings.queue_for(model)] = NOW_S - oldest
        expected[settings.queue_for(MODELS[-1])] = None
    finally:
        app.close()
    pool = redis.ConnectionPool.from_url(redis_server.url, connection_class=CountingConnection)
    client: redis.Redis[bytes] = redis.Redis(connection_pool=pool)
    try:
        CountingConnection.writes.clear()
        state = read_fleet_state(settings, client, now_s=NOW_S)
        lindex_trips = sum(1 for write in CountingConnection.writes if b"LINDEX" in write.upper())
        per_queue = {q: oldest_waiting_age_s(client, q, NOW_S) for q in expected}
    finally:
        client.close()
    assert state.redis_error is None, state.redis_error
    ages = {m.queue: m.oldest_waiting_s for m in state.models}
    assert ages == expected == per_queue, (ages, expected, per_queue)
    assert lindex_trips == 1, f"{lindex_trips} round trips read the oldest waiting requests of {len(MODELS)} models"
