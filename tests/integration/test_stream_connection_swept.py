"""The worker's stream publisher gives its writes' connection back to the pool when idle, so the heartbeat's
sweep releases it after a Redis restart.

The publisher takes a connection from its client's pool for its writes and kept it for good
(:class:`workers.stream_write_script.ScriptConnection`): out of the pool, no sweep could see it, so after a Redis
restart a worker that had streamed generations and then stayed idle held that socket half-closed (``CLOSE_WAIT``,
an fd) until its next streamed token (found by ``tests/integration/test_leaks_traffic.py`` once it counted those
sockets: 1 per worker). Now the connection goes back to the pool once nothing is held and no stream is open.

Real redis-server (killed and started again on its port); the publisher runs as in a worker, on a
:func:`protocol.redis_conn.sync_client`, and :func:`protocol.redis_pools.sweep_process_pools` is what the worker
calls after each heartbeat.
"""

from __future__ import annotations

import contextlib
import os

from protocol.keys import STREAM_KEY
from protocol.messages import Usage
from protocol.redis_conn import sync_client
from protocol.redis_pools import sweep_process_pools
from protocol.settings import load_settings
from protocol.streams import StreamEvent, decode_events
from tests.integration.ops_fixtures import wait_until
from tests.integration.test_pool_close_wait import _close_wait
from tools.processes import poll_until
from tools.redis_server import EmbeddedRedis
from workers.stream_publisher import StreamPublisher

RELEASE_S = 10.0
"""Bound of the wait for the half-closed socket to go (s): a failure bound only."""


def test_an_idle_stream_publisher_leaves_no_socket_a_redis_restart_closed(redis_server: EmbeddedRedis) -> None:
    me, port = os.getpid(), redis_server.port
    publisher = StreamPublisher(sync_client(load_settings("/dev/null", redis_url=redis_server.url), socket_timeout=5),
                                ttl_s=60)  # fmt: skip
    publisher.start()
    try:
        with redis_server.client() as reader:
            events = [StreamEvent(type="token", index=i, token_id=100 + i, text=f"<{i}>") for i in range(3)]
            for event in [*events, StreamEvent(type="final", index=3, finish_reason="length",
                                               usage=Usage(prompt_tokens=2, completion_tokens=3, total_tokens=5))]:
                publisher.publish("r1", event)

            def ended() -> bool:
                entries = reader.xrange(STREAM_KEY.format(id="r1"))
                return any(e.type == "final" for _, fields in entries for e in decode_events(fields))

            wait_until(ended, 10, "the stream written to its end")
        redis_server.kill()
        redis_server.start()
        wait_until(lambda: _close_wait(me, port) > 0, 30, "the publisher's socket to be closed by Redis")
        before = _close_wait(me, port)

        def swept() -> bool:  # the worker's heartbeat: a sweep per beat
            sweep_process_pools()
            return _close_wait(me, port) == 0

        with contextlib.suppress(TimeoutError):
            poll_until(swept, RELEASE_S, "the half-closed socket to go", poll_s=0.2)
        left = _close_wait(me, port)
    finally:
        publisher.stop(timeout_s=5)
    assert left == 0, f"{left} of {before} sockets to Redis stay half-closed after the restart and the sweeps"
