"""Factories for integration tests: real redis-server, real worker subprocesses, real models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from producer.client import FleetClient
from protocol.settings import FleetSettings, deep_merge, load_settings
from tools.processes import WorkerProcess, stop_workers

__all__ = ["Fleet", "base_config"]


def base_config(model_dir: Path, redis_url: str) -> dict[str, Any]:
    """A YAML-shaped config serving the demo LM and encoder built in ``model_dir``."""
    return {
        "redis_url": redis_url,
        "result_ttl_s": 600,
        "visibility_timeout_s": 3600,
        "worker": {"model": "demo-lm", "concurrency": 8, "heartbeat_s": 0.5},
        "models": {
            "demo-lm": {
                "path": str(model_dir / "demo-lm" / "demo-lm-1.0.0.onnx"),
                "batching": {"max_batch_size": 8, "max_wait_ms": 2.0},
                "limits": {"max_input_tokens": 128},
                "engine": {"intra_op_threads": 1},
            },
            "demo-llama": {
                "path": str(model_dir / "demo-llama" / "demo-llama-1.0.0.onnx"),
                "batching": {"max_batch_size": 8, "max_wait_ms": 2.0},
                "limits": {"max_input_tokens": 128},
                "engine": {"intra_op_threads": 1},
            },
            "demo-encoder": {
                "path": str(model_dir / "demo-encoder" / "demo-encoder-1.0.0.onnx"),
                "batching": {"max_batch_size": 8, "max_wait_ms": 2.0},
                "limits": {"max_input_tokens": 128},
                "engine": {"intra_op_threads": 1},
            },
        },
    }


class Fleet:
    """Writes configs, starts workers and clients for one test; stops them all at teardown."""

    def __init__(self, tmp_path: Path, model_dir: Path, redis_url: str) -> None:
        self.tmp_path = tmp_path
        self.model_dir = model_dir
        self.redis_url = redis_url
        self.workers: list[WorkerProcess] = []
        self.clients: list[FleetClient] = []
        self._configs = 0

    def config(self, **overrides: Any) -> Path:
        """Write a YAML config (base + ``overrides``, merged deeply); returns its path."""
        self._configs += 1
        path = self.tmp_path / f"fleet-{self._configs}.yaml"
        path.write_text(yaml.safe_dump(deep_merge(base_config(self.model_dir, self.redis_url), overrides)))
        return path

    def settings(self, config: Path) -> FleetSettings:
        return load_settings(config)

    def worker(self, config: Path, model: str = "demo-lm", concurrency: int = 8, *, wait: bool = True,
               hostname: str | None = None, python: str | None = None, include: str | None = None) -> WorkerProcess:
        """Start a real ``celery worker`` subprocess for ``model``; waits until ready unless ``wait=False``.
        ``include``: a test plugin module the worker imports too (Celery's ``--include``), for its test tasks."""
        settings = load_settings(config)
        n = len(self.workers) + 1
        proc = WorkerProcess(model=model, queue=settings.queue_for(model), redis_url=self.redis_url,
                             concurrency=concurrency, hostname=hostname or f"w{n}-{model}@test",
                             env={"FLEET_CONFIG": str(config)}, log_path=self.tmp_path / f"worker-{n}.log",
                             python=python)
        if include:
            proc.cmd += ["--include", include]
        self.workers.append(proc.start())
        if wait:
            proc.wait_ready(120)
        return proc

    def client(self, config: Path) -> FleetClient:
        c = FleetClient(load_settings(config))
        self.clients.append(c)
        return c

    def close(self) -> None:
        """Stop every worker (SIGTERM to all first, so their warm shutdowns overlap) and close the clients."""
        stop_workers(self.workers, timeout_s=15)
        for c in self.clients:
            c.close()
