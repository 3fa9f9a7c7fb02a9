"""A two-worker-host fleet whose ``w1`` reaches the network through a :class:`~tests.integration.partition_net.TapLink`.

Shared by ``tests/integration/test_partitions*.py``: :func:`partition_fleet` starts Redis, ``w1`` (behind
the TAP link, with a long batch window so a fault always finds it holding requests) and ``w2`` on the
lab's hosts (:class:`tools.multihost.HostFleet`); :class:`SubmitLoad` submits from the client host;
:class:`ResultWrites` counts every result write (the store script publishes a result only when it writes
one); :func:`heartbeat` reads a worker's heartbeat as every reader of readiness does.
"""

from __future__ import annotations

import json
import re
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from producer.client import FleetClient
from protocol.keys import WORKER_KEY_PREFIX
from protocol.settings import load_settings
from tests.integration.paced_load import PacedLoad
from tests.integration.partition_net import TapLink
from tools.build_identity import build_identity
from tools.multihost import HostFleet
from tools.netns import NetHost
from tools.processes import WorkerProcess

__all__ = [
    "PROMPTS",
    "PartitionFleet",
    "ReadinessSamples",
    "SubmitLoad",
    "computed_in",
    "heartbeat",
    "partition_fleet",
    "received_in",
]

PROMPTS = [[3 + i] * (2 + i % 5) + [10 + 7 * i] for i in range(12)]
_RECEIVED = re.compile(r"Task fleet\.infer\[([0-9a-f]+)\] received")
_SUCCEEDED = re.compile(r"Task fleet\.infer\[([0-9a-f]+)\] succeeded")


@dataclass
class PartitionFleet:
    hf: HostFleet
    link: TapLink
    w1: WorkerProcess
    w2: WorkerProcess
    client: FleetClient
    queue: str

    @property
    def redis_ip(self) -> str:
        return self.hf.redis_host.ip


@contextmanager
def partition_fleet(tmp_path: Path, *, visibility_s: float, hold_ms: float, heartbeat_s: float = 0.5
                    ) -> Iterator[PartitionFleet]:  # fmt: skip
    """Redis, ``w1`` (TAP link, batch window ``hold_ms``) and ``w2``, both ready, and a client on the client host.

    Yields the fleet; its client must be used from the client host only (:meth:`HostFleet.on_client`).
    """
    model = build_identity(tmp_path / "models")
    with HostFleet(tmp_path, worker_hosts=2) as hf, TapLink(hf.worker_hosts[0]) as link:
        hf.start_redis()
        common: dict[str, Any] = {"visibility_timeout_s": visibility_s, "worker": {"heartbeat_s": heartbeat_s}}
        normal = hf.config(model, **common)
        holding = hf.config(
            model,
            **common | {"worker": {"heartbeat_s": heartbeat_s, "concurrency": 16}},
            models={"identity": {"batching": {"max_batch_size": 16, "max_wait_ms": hold_ms, "close_when_idle": False}}},
        )
        w1 = hf.worker(hf.worker_hosts[0], holding, concurrency=16)
        w2 = hf.worker(hf.worker_hosts[1], normal)
        hf.wait_workers()
        client = hf.on_client(FleetClient, load_settings(normal))
        try:
            yield PartitionFleet(hf, link, w1, w2, client, client.settings.queue_for("identity"))
        finally:
            hf.on_client(client.close)


def heartbeat(pf: PartitionFleet, w: WorkerProcess) -> dict[str, Any] | None:
    """``w``'s heartbeat document, None while it has none in Redis (it expired: the worker is not counted)."""
    raw = pf.hf.on_client(pf.client.redis.get, WORKER_KEY_PREFIX + w.hostname)
    return json.loads(raw) if raw else None


def received_in(w: WorkerProcess) -> Counter[str]:
    return _count(w, _RECEIVED)


def computed_in(w: WorkerProcess) -> Counter[str]:
    """Request IDs ``w`` computed (Celery's ``succeeded`` line), each with how many times."""
    return _count(w, _SUCCEEDED)


def _count(w: WorkerProcess, pattern: re.Pattern[str]) -> Counter[str]:
    if w.log_path is None or not w.log_path.exists():
        return Counter()
    return Counter(pattern.findall(w.log_path.read_text(errors="replace")))


class SubmitLoad(PacedLoad):
    """Submits ``rate_per_s`` identity requests a second with ``client``, from a thread on ``host``, until stopped."""

    def __init__(self, host: NetHost, client: FleetClient, rate_per_s: float = 20.0) -> None:
        super().__init__(host, len(PROMPTS), rate_per_s, "partition-load")
        self.client = client

    def send(self, n: int) -> str:
        return self.client.submit("identity", PROMPTS[n])


class ReadinessSamples:
    """How often ``w1``'s heartbeat was found ready, unready or absent (read every 0.1 s, a measurement only)."""

    def __init__(self, pf: PartitionFleet) -> None:
        self.pf = pf
        self.counts: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="readiness-samples", daemon=True)

    def start(self) -> ReadinessSamples:
        self._thread.start()
        return self

    def _run(self) -> None:
        self.pf.hf.client_host.enter()
        key = WORKER_KEY_PREFIX + self.pf.w1.hostname
        while not self._stop.wait(0.1):
            raw = self.pf.client.redis.get(key)
            self.counts["absent" if not raw else "ready" if json.loads(raw)["ready"] else "unready"] += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
