"""Every result write in a lab (:mod:`tools.multihost`), heard from its client host: the fleet's result store
script publishes a result on ``celery-task-meta-<id>`` when, and only when, it writes one (a kept outcome is
not published), so the writes per request ID say whether any result was written twice."""

from __future__ import annotations

import json
import threading
from collections import defaultdict
from typing import Any

from tools.multihost import HostFleet

__all__ = ["ResultWrites"]


class ResultWrites:
    """Each write's meta (status, result, task_id) by request ID, from :meth:`start` to :meth:`stop`."""

    def __init__(self, hf: HostFleet) -> None:
        self.hf = hf
        self.writes: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="result-writes", daemon=True)

    def start(self) -> ResultWrites:
        self._thread.start()
        if not self._ready.wait(10):
            raise TimeoutError("the result-write listener did not subscribe")
        return self

    def _run(self) -> None:
        self.hf.client_host.enter()
        client = self.hf.redis_client()
        pubsub = client.pubsub(ignore_subscribe_messages=True)
        pubsub.psubscribe("celery-task-meta-*")
        pubsub.get_message(timeout=5)  # the subscription's confirmation
        self._ready.set()
        while not self._stop.is_set():
            msg = pubsub.get_message(timeout=0.2)
            if msg is not None:
                meta = json.loads(msg["data"])
                self.writes[meta["task_id"]].append(meta)
        pubsub.close()
        client.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def __enter__(self) -> ResultWrites:
        """Listen (:meth:`start`) for the block; stopped when it ends, however it ends: before the lab's hosts are
        torn down, so the listener never outlives its network (a failed test left it to crash in the next one)."""
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
