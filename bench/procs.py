"""The processes under test: fleet workers started from a generated YAML config, and their meters.

Each configuration gets its own ``fleet.yaml`` in the bench's work folder (``FLEET_CONFIG`` points
the worker and the client at it), its own worker subprocess, and the same private Redis.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psutil
import redis
import yaml

from producer.client import FleetClient
from protocol.settings import FleetSettings, load_settings
from tools.processes import WorkerProcess

LEAN_OVERRIDES: dict[str, Any] = {
    "worker_send_task_events": False,
    "task_send_sent_event": False,
    "task_track_started": False,
    "result_extended": False,
}
"""Celery settings the lean measurement turns off (all per-task extras of protocol/celeryconf.py)."""

__all__ = [
    "LEAN_OVERRIDES",
    "CpuMeter",
    "FleetConfig",
    "RunningFleet",
    "flush_redis",
    "metered",
    "peak_rss_bytes",
    "redis_commandstats",
]


@dataclass(frozen=True)
class FleetConfig:
    """One served configuration of the table (a model file plus batching and engine settings)."""

    label: str
    model_name: str
    model_path: Path
    max_batch_size: int = 8
    max_wait_ms: float = 2.0
    concurrency: int = 16
    max_input_tokens: int = 256
    providers: tuple[str, ...] = ("CPUExecutionProvider",)
    engine_extra: dict[str, Any] = field(default_factory=dict)
    celery_loglevel: str = "INFO"
    """Celery's own log level (``fleet worker``'s default INFO logs every task twice)."""
    continuous: bool = True
    """Generation: continuous batching (False = static: a batch runs until its last sequence ends)."""
    max_new_tokens: int = 256
    """Generation: the largest ``max_new_tokens`` a request may ask for."""
    metrics_port: int = 0
    """The worker's Prometheus port (0 = off); the generation rows read its step and KV-copy times."""
    lean: bool = False
    """Measurement only: run the worker through :mod:`bench.lean_worker` with Celery's per-task
    extras off (task events, STARTED state, extended results), to price them."""
    batching_extra: dict[str, Any] = field(default_factory=dict)
    """More ``models.<m>.batching`` settings (e.g. ``prefix_cache_bytes``)."""
    routing: dict[str, Any] = field(default_factory=dict)
    """The ``models.<m>.routing`` section (e.g. ``{"prefix_aware": False}``)."""
    celery: dict[str, bool] = field(default_factory=dict)
    """The ``celery`` settings section (:class:`protocol.settings.CelerySettings`) of this worker and its
    client, e.g. ``{"task_events": False}`` (then the worker also runs without ``-E``)."""

    def yaml_doc(self, redis_url: str) -> dict[str, Any]:
        """The settings document for ``FLEET_CONFIG``."""
        doc: dict[str, Any] = {
            "redis_url": redis_url,
            "result_ttl_s": 600,
            "visibility_timeout_s": 600,
            "worker": {
                "model": self.model_name,
                "concurrency": self.concurrency,
                "loglevel": "WARNING",
                "metrics_port": self.metrics_port,
            },
            "models": {
                self.model_name: {
                    "path": str(self.model_path.resolve()),
                    "batching": {
                        "max_batch_size": self.max_batch_size,
                        "max_wait_ms": self.max_wait_ms,
                        "max_batch_tokens": self.max_batch_size * self.max_input_tokens,
                        "continuous": self.continuous,
                        **self.batching_extra,
                    },
                    **({"routing": dict(self.routing)} if self.routing else {}),
                    "limits": {"max_input_tokens": self.max_input_tokens, "max_new_tokens": self.max_new_tokens},
                    "engine": {"providers": list(self.providers), **self.engine_extra},
                    "max_queue_depth": 100_000,
                }
            },
            **({"celery": dict(self.celery)} if self.celery else {}),
        }
        return doc

    def write(self, folder: Path, redis_url: str) -> Path:
        """Write ``<folder>/<label>.yaml``; returns its path."""
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{self.label}.yaml"
        path.write_text(yaml.safe_dump(self.yaml_doc(redis_url), sort_keys=False))
        return path


def peak_rss_bytes(pid: int) -> int:
    """Peak resident set size of ``pid`` (bytes): ``VmHWM`` on Linux, else the current RSS."""
    status = Path(f"/proc/{pid}/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return int(psutil.Process(pid).memory_info().rss)


class CpuMeter:
    """CPU seconds (user + system, all threads) spent by a set of processes between two reads."""

    def __init__(self, pids: dict[str, int]) -> None:
        self._procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self._start = self._read()

    def _read(self) -> dict[str, float]:
        out = {}
        for name, proc in self._procs.items():
            t = proc.cpu_times()
            out[name] = float(t.user + t.system)
        return out

    def elapsed(self) -> dict[str, float]:
        """CPU seconds per process since construction."""
        now = self._read()
        return {name: now[name] - self._start[name] for name in now}


def redis_commandstats(url: str) -> dict[str, int]:
    """Calls per Redis command so far (``INFO commandstats``), e.g. ``{"lpush": 120, ...}``."""
    client = redis.Redis.from_url(url)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return {key.removeprefix("cmdstat_"): int(value["calls"]) for key, value in stats.items()}


T = TypeVar("T")


def metered(pids: dict[str, int], redis_url: str, run: Callable[[], T]) -> tuple[T, dict[str, float], dict[str, int]]:
    """Run ``run()``; return its result, the CPU seconds each of ``pids`` spent meanwhile (:class:`CpuMeter`)
    and the Redis calls by command meanwhile (``INFO commandstats`` deltas; our own ``info`` included)."""
    meter = CpuMeter(pids)
    before = redis_commandstats(redis_url)
    result = run()
    cpu_s = meter.elapsed()
    after = redis_commandstats(redis_url)
    return result, cpu_s, {k: v - before.get(k, 0) for k, v in after.items()}


class RunningFleet:
    """A worker for one :class:`FleetConfig`, plus a client bound to the same settings.

    ``start()`` returns once the worker's heartbeat says ready; ``stop()`` shuts both down.
    """

    def __init__(self, config: FleetConfig, redis_url: str, work_dir: Path) -> None:
        self.config = config
        self.redis_url = redis_url
        self.config_path = config.write(work_dir / "configs", redis_url)
        self.log_path = work_dir / "logs" / f"{config.label}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.settings: FleetSettings = load_settings(self.config_path)
        self.worker = WorkerProcess(
            model=config.model_name,
            queue=self.settings.queue_for(config.model_name),
            redis_url=redis_url,
            concurrency=config.concurrency,
            env={"FLEET_CONFIG": str(self.config_path)},
            log_path=self.log_path,
            cwd=Path.cwd(),
        )
        cmd = self.worker.cmd
        cmd[cmd.index("--loglevel") + 1] = config.celery_loglevel
        if config.celery.get("task_events") is False:
            cmd.remove("-E")
        if config.lean:  # [python, -m, celery, -A, workers.app, worker, …] → bench.lean_worker
            cmd[1:5] = ["-m", "bench.lean_worker"]
            cmd.remove("-E")
            self.worker.env["BENCH_CELERY_OVERRIDES"] = json.dumps(LEAN_OVERRIDES)
        self.client: FleetClient | None = None
        self.start_s = 0.0
        self._began = 0.0
        self.providers: list[str] = []
        """The execution providers active in the worker's session (its ready heartbeat)."""
        self.nodes: dict[str, int] = {}
        """Nodes per execution provider the worker counted at model load (its ready heartbeat; empty when
        it did not count them)."""

    @property
    def pid(self) -> int:
        """Process id of the worker."""
        assert self.worker.proc is not None
        return int(self.worker.proc.pid)

    def spawn(self) -> None:
        """Start the worker process (returns at once; see :meth:`ready`)."""
        self._began = time.monotonic()
        self.worker.start()

    def ready(self, timeout_s: float = 180.0) -> FleetClient:
        """Wait until the worker's heartbeat says ready; return a client (seconds to ready in ``start_s``)."""
        ready = self.worker.wait_ready(timeout_s)
        self.start_s = time.monotonic() - self._began
        active = ready.get("providers")
        self.providers = [str(p) for p in active] if isinstance(active, list) else []
        nodes = ready.get("nodes")
        self.nodes = {str(k): int(v) for k, v in nodes.items()} if isinstance(nodes, dict) else {}
        self.client = FleetClient(self.settings)
        if self.config.lean:
            self.client.app.conf.task_send_sent_event = False
        return self.client

    def start(self, timeout_s: float = 180.0) -> FleetClient:
        """:meth:`spawn` then :meth:`ready`."""
        self.spawn()
        return self.ready(timeout_s)

    def stop(self) -> None:
        """Stop the worker (warm shutdown) and close the client."""
        if self.client is not None:
            self.client.close()
            self.client = None
        self.worker.stop(timeout_s=30)


def flush_redis(url: str) -> None:
    """Empty the bench's private Redis between configurations."""
    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()
