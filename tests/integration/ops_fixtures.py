"""Fixtures for the operations tests: real Redis, real worker and gateway processes, real HTTP.

Import the fixtures you use into a test module (``from tests.integration.ops_fixtures import
ops_fleet, ops_models, ops_redis``). Redis and the models live for one module; :class:`OpsFleet`
(one per test) flushes Redis first and stops every process it started.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx
import pytest
import redis
import yaml
from prometheus_client.parser import text_string_to_metric_families

from protocol.settings import load_settings
from tools.build_encoder import build_encoder
from tools.build_lm import build_causal_lm
from tools.processes import WorkerProcess, log_since, poll_until, stop_workers
from tools.redis_server import PORT_PICKS, EmbeddedRedis, free_port

__all__ = [
    "API_KEY",
    "ROOT",
    "GatewayProcess",
    "OpsFleet",
    "ops_fleet",
    "ops_models",
    "ops_redis",
    "scrape",
    "wait_until",
]

API_KEY = "test-key-1"
ROOT = Path(__file__).resolve().parents[2]


def wait_until(check: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.05) -> Any:
    """Poll ``check()`` until it returns something truthy (returned); fail the test after ``timeout_s``."""
    try:
        return poll_until(check, timeout_s, what, poll_s)
    except TimeoutError as exc:
        pytest.fail(str(exc))


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """One Prometheus scrape as ``{(sample name, sorted labels): value}``."""
    text = httpx.get(url, timeout=5).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return out


@dataclass
class ModelPaths:
    lm: Path
    encoder: Path


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


class GatewayProcess:
    """``fleet api`` in a subprocess on a free port (picked again when another process binds it first)."""

    def __init__(self, config: Path, log_path: Path, log_level: str = "warning") -> None:
        self._log: IO[bytes] = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.log_path = log_path
        self._config, self._log_level = config, log_level
        self._picks = PORT_PICKS
        self._spawn()

    def _spawn(self) -> None:
        self._picks -= 1
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log_from = self.log_path.stat().st_size
        cmd = [sys.executable, "-m", "producer.cli", "api", "--config", str(self._config), "--host", "127.0.0.1",
               "--port", str(self.port), "--no-access-log", "--log-level", self._log_level]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )

    def wait_ready(self, timeout_s: float = 30) -> GatewayProcess:
        def up() -> bool:
            if self.proc.poll() is not None:
                said = log_since(self.log_path, self._log_from)
                if "already in use" in said and self._picks > 0:  # a free port is free only
                    self._spawn()  # until another process binds it
                    return False
                pytest.fail(f"gateway exited with {self.proc.returncode}: {said[-3000:]}")
            try:
                return httpx.get(self.url + "/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, timeout_s, f"gateway on {self.url}", poll_s=0.1)
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


class OpsFleet:
    """Config writer and process factory for one test; :meth:`close` stops everything it started."""

    def __init__(self, tmp_path: Path, models: ModelPaths, server: EmbeddedRedis) -> None:
        self.tmp_path = tmp_path
        self.models = models
        self.server = server
        self.redis_url = server.url
        self.redis = redis.Redis.from_url(server.url)
        self.redis.flushall()
        self.workers: list[WorkerProcess] = []
        self.gateways: list[GatewayProcess] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self._n = 0

    def config(self, *, serve: tuple[str, ...] = ("demo-lm", "demo-encoder"), **overrides: Any) -> Path:
        """Write a YAML config (API keys on, the ``serve`` models of demo-lm/demo-encoder, + ``overrides``)."""
        specs: dict[str, Any] = {
            "demo-lm": {"path": str(self.models.lm), "limits": {"max_input_tokens": 64}},
            "demo-encoder": {"path": str(self.models.encoder), "limits": {"max_input_tokens": 64}},
        }
        base: dict[str, Any] = {
            "redis_url": self.redis_url,
            "result_ttl_s": 600,
            "worker": {"model": "demo-lm", "concurrency": 8, "heartbeat_s": 0.5},
            "models": {
                name: {**spec, "engine": {"intra_op_threads": 1}} for name, spec in specs.items() if name in serve
            },
            "api": {"api_keys": [API_KEY], "max_body_bytes": 4096, "max_batch_requests": 16},
        }
        self._n += 1
        path = self.tmp_path / f"fleet-{self._n}.yaml"
        path.write_text(yaml.safe_dump(_merge(base, overrides)))
        return path

    def worker(
        self, config: Path, model: str = "demo-lm", *, metrics_port: int = 0, wait: bool = True
    ) -> WorkerProcess:
        """A real ``celery worker`` for ``model`` (metrics on ``metrics_port`` when set)."""
        settings = load_settings(config)
        self._n += 1
        env = {"FLEET_CONFIG": str(config), "FLEET_WORKER__METRICS_PORT": str(metrics_port)}
        proc = WorkerProcess(
            model=model,
            queue=settings.queue_for(model),
            redis_url=self.redis_url,
            concurrency=8,
            hostname=f"w{self._n}-{model}@ops",
            env=env,
            log_path=self.tmp_path / f"worker-{self._n}.log",
            cwd=ROOT,
        )
        self.workers.append(proc.start())
        if wait:
            proc.wait_ready(60)
        return proc

    def gateway(self, config: Path, log_level: str = "warning") -> GatewayProcess:
        """A real ``fleet api`` process, answering /healthz."""
        return self.gateway_replicas(config, 1, log_level)[0]

    def gateway_replicas(self, config: Path, n: int, log_level: str = "warning") -> list[GatewayProcess]:
        """``n`` real ``fleet api`` processes on one config, started together, all answering /healthz."""
        started = []
        for _ in range(n):
            self._n += 1
            started.append(GatewayProcess(config, self.tmp_path / f"gateway-{self._n}.log", log_level))
        self.gateways.extend(started)
        return [gw.wait_ready() for gw in started]

    def spawn(self, cmd: list[str], env: dict[str, str] | None = None, name: str = "proc") -> subprocess.Popen[bytes]:
        """Any other long-running process (Flower); terminated at close."""
        self._n += 1
        log = open(self.tmp_path / f"{name}-{self._n}.log", "ab")  # noqa: SIM115 - the child holds it
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        log.close()
        self.procs.append(proc)
        return proc

    def fleet_cli(self, config: Path, *args: str, module: str = "producer.cli") -> subprocess.CompletedProcess[str]:
        """Run ``fleet <args> --config <config>`` to completion (``module="producer.ops_cli"``: the
        operator commands alone, which start faster)."""
        return subprocess.run(
            [sys.executable, "-m", module, *args, "--config", str(config)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    def close(self) -> None:
        for gw in self.gateways:
            gw.stop()
        stop_workers(self.workers, timeout_s=15)
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(5)
        self.redis.close()


@pytest.fixture(scope="module")
def ops_models(tmp_path_factory: pytest.TempPathFactory) -> ModelPaths:
    """The demo LM and encoder, built once per module."""
    root = tmp_path_factory.mktemp("ops-models")
    return ModelPaths(lm=build_causal_lm(root), encoder=build_encoder(root))


@pytest.fixture(scope="module")
def ops_redis() -> Iterator[EmbeddedRedis]:
    """One redis-server per module (each test's :class:`OpsFleet` flushes it)."""
    with EmbeddedRedis() as server:
        yield server


def closing_answer(sock: socket.socket) -> tuple[int, dict[str, Any]]:
    """Read a raw-socket HTTP answer until the gateway closes the connection (it must say ``Connection: close``);
    its status and JSON body. The socket's own timeout bounds the wait."""
    raw = b""
    while chunk := sock.recv(65536):
        raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower(), raw
    return int(head.split()[1]), json.loads(body)


def lone_gateway(tmp_path_factory: pytest.TempPathFactory, models: ModelPaths, server: EmbeddedRedis, name: str,
                 api: dict[str, Any]) -> Iterator[GatewayProcess]:  # fmt: skip
    """A module fixture's body: one real gateway, no worker, on a config with these ``api`` settings; everything
    stopped when the module is done."""
    fleet = OpsFleet(tmp_path_factory.mktemp(name), models, server)
    try:
        yield fleet.gateway(fleet.config(api=api))
    finally:
        fleet.close()


@pytest.fixture
def ops_fleet(tmp_path: Path, ops_models: ModelPaths, ops_redis: EmbeddedRedis) -> Iterator[OpsFleet]:
    """A fresh :class:`OpsFleet` on the module's Redis, flushed; everything stopped afterwards."""
    fleet = OpsFleet(tmp_path, ops_models, ops_redis)
    try:
        yield fleet
    finally:
        fleet.close()
