"""A fleet spread over hosts of a :class:`~tools.netns.NetLab`: Redis, workers, the gateway, a client.

Every host is a network namespace on this machine with one address on the lab's private /24:

* ``redis``: ``redis-server`` bound to that address only (nothing listens on loopback);
* ``w1``, ``w2``, …: real ``celery worker`` processes of this project (``FLEET_REDIS_URL`` = the
  Redis host's address), added with :meth:`HostFleet.worker`;
* ``gw``: the gateway (``fleet api``) listening on its address, :meth:`HostFleet.gateway`;
* ``client``: where load generators and checks run (:meth:`HostFleet.on_client`).

Used by ``tests/integration/test_multihost.py`` (a worker host cut off under load) and
``bench/multihost.py`` (requests/s with 1, 2 and 3 worker hosts). Processes are stopped and the
namespaces removed by :meth:`HostFleet.close`, also when a step failed.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, TypeVar

import httpx
import redis
import yaml

from protocol.settings import deep_merge, load_settings
from tools.netns import NetHost, NetLab
from tools.processes import WorkerProcess, poll_until, stop_process
from tools.redis_server import find_redis_server

__all__ = ["GATEWAY_PORT", "REDIS_PORT", "HostFleet", "identity_config"]

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[1]
REDIS_PORT = 6379
GATEWAY_PORT = 8000


def identity_config(model_path: Path, redis_url: str, **overrides: Any) -> dict[str, Any]:
    """A YAML-shaped fleet config serving the identity model at ``model_path`` (``overrides`` merged deeply)."""
    base: dict[str, Any] = {
        "redis_url": redis_url,
        "result_ttl_s": 600,
        "worker": {"model": "identity", "concurrency": 8, "heartbeat_s": 0.5},
        "models": {"identity": {"path": str(model_path), "batching": {"max_batch_size": 8, "max_wait_ms": 2.0},
                                "limits": {"max_input_tokens": 128}, "engine": {"intra_op_threads": 1}}},
    }
    return deep_merge(base, overrides)


class HostFleet:
    """Hosts ``redis``, ``gw``, ``client`` and ``worker_hosts`` worker hosts (``w1``…) on one private lab.

    Args:
        folder: where configs, logs and Redis's folder go.
        worker_hosts: how many worker hosts to make (workers start with :meth:`worker`).

    Raises:
        tools.netns.NetnsError: the lab could not be made (not root, no namespaces).
    """

    def __init__(self, folder: Path, worker_hosts: int = 3) -> None:
        self.folder = folder
        self.lab = NetLab()
        self._procs: list[tuple[str, subprocess.Popen[bytes], IO[bytes]]] = []
        self.workers: list[WorkerProcess] = []
        self._configs = 0
        try:
            self.lab.open()
            self.redis_host = self.lab.add("redis")
            self.gw_host = self.lab.add("gw")
            self.client_host = self.lab.add("client")
            self.worker_hosts = [self.lab.add(f"w{i + 1}") for i in range(worker_hosts)]
        except BaseException:
            self.lab.close()
            raise

    # -- addresses --------------------------------------------------------------------------------
    @property
    def redis_url(self) -> str:
        """``redis://<redis host's address>:6379/0``."""
        return f"redis://{self.redis_host.ip}:{REDIS_PORT}/0"

    @property
    def gateway_url(self) -> str:
        """``http://<gw host's address>:8000``."""
        return f"http://{self.gw_host.ip}:{GATEWAY_PORT}"

    def host_of(self, address: str) -> str | None:
        """The name of the host that has ``address`` (None when no host of the lab has it)."""
        return next((h.name for h in self.lab.hosts.values() if h.ip == address), None)

    # -- processes --------------------------------------------------------------------------------
    def _spawn(self, name: str, host: NetHost, argv: list[str], env: dict[str, str] | None = None) -> None:
        log = open(self.folder / f"{name}.log", "ab")  # noqa: SIM115 - closed in close()
        proc = host.popen(argv, env=env, log=log, cwd=ROOT)
        self._procs.append((name, proc, log))

    def start_redis(self, timeout_s: float = 15.0) -> None:
        """``redis-server`` on the redis host, bound to its address only; waits until it answers PING.

        Raises:
            TimeoutError: no answer within ``timeout_s``.
        """
        data = Path(tempfile.mkdtemp(prefix="redis-", dir=self.folder))
        self._spawn("redis", self.redis_host, [
            find_redis_server(), "--bind", self.redis_host.ip, "--port", str(REDIS_PORT), "--save", "",
            "--appendonly", "no", "--dir", str(data), "--protected-mode", "no", "--loglevel", "warning",
        ])

        def ping(client: redis.Redis[bytes]) -> bool:
            self._check_alive("redis")
            try:
                return bool(client.ping())
            except redis.ConnectionError:
                return False

        self.wait(lambda: self.ask_redis(ping), timeout_s, "redis-server on the redis host")

    def config(self, model_path: Path, **overrides: Any) -> Path:
        """Write an identity-model config pointing at the redis host (``overrides`` merged); returns its path."""
        self._configs += 1
        path = self.folder / f"fleet-{self._configs}.yaml"
        path.write_text(yaml.safe_dump(identity_config(model_path, self.redis_url, **overrides)))
        return path

    def worker(self, host: NetHost, config: Path, *, concurrency: int = 8) -> WorkerProcess:
        """Start a ``celery worker`` for the identity model on ``host`` (not waited for: see :meth:`wait_workers`)."""
        settings = load_settings(config)
        w = WorkerProcess(model="identity", queue=settings.queue_for("identity"), redis_url=self.redis_url,
                          concurrency=concurrency, hostname=f"{host.name}@{host.ip}",
                          env={"FLEET_CONFIG": str(config)}, log_path=self.folder / f"worker-{host.name}.log",
                          cwd=ROOT)
        w.cmd[:0] = host.command([])
        self.workers.append(w.start())
        return w

    def wait_workers(self, workers: Sequence[WorkerProcess] | None = None, timeout_s: float = 120.0) -> None:
        """Block until each of ``workers`` (default: every started one) says ready in its heartbeat.

        Raises:
            RuntimeError: a worker exited first; TimeoutError: one was not ready within ``timeout_s``.
        """
        for w in self.workers if workers is None else workers:
            self.on_client(w.wait_ready, timeout_s)

    def gateway(self, config: Path, timeout_s: float = 60.0) -> str:
        """Start ``fleet api`` on the gw host, listening on its address; waits for /healthz; returns its URL."""
        self._spawn("gateway", self.gw_host, [
            sys.executable, "-m", "producer.cli", "api", "--config", str(config), "--host", self.gw_host.ip,
            "--port", str(GATEWAY_PORT), "--no-access-log", "--log-level", "warning",
        ], env={**os.environ, "PYTHONUNBUFFERED": "1"})
        url = self.gateway_url

        def healthy() -> bool:
            self._check_alive("gateway")
            try:
                return httpx.get(url + "/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        self.wait(lambda: self.on_client(healthy), timeout_s, f"the gateway on {url}")
        return url

    def _check_alive(self, name: str) -> None:
        for n, proc, _ in self._procs:
            if n == name and proc.poll() is not None:
                tail = (self.folder / f"{name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} exited with {proc.returncode}: {tail}")

    def pid_of(self, name: str) -> int:
        """Process id of a started service (``redis``, ``gateway``): ``ip netns exec`` execs it, same pid."""
        return next(proc.pid for n, proc, _ in self._procs if n == name)

    # -- reaching the hosts -----------------------------------------------------------------------
    def on_client(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` on a thread inside the client host (its sockets leave from the client's address)."""
        return self.client_host.call(fn, *args, **kwargs)

    def redis_client(self) -> redis.Redis[bytes]:
        """A redis-py client for the redis host; use it only inside a host (e.g. in :meth:`on_client`); close it."""
        return redis.Redis(host=self.redis_host.ip, port=REDIS_PORT, socket_connect_timeout=2, socket_timeout=5)

    def ask_redis(self, fn: Callable[[redis.Redis[bytes]], T]) -> T:
        """``fn(client)`` from the client host, on a fresh Redis client closed afterwards."""

        def run() -> T:
            with self.redis_client() as client:
                return fn(client)

        return self.on_client(run)

    def wait(self, check: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.05) -> Any:
        """Poll ``check()`` until truthy (returned).

        Raises:
            TimeoutError: still falsy after ``timeout_s``.
        """
        return poll_until(check, timeout_s, what, poll_s)

    # -- teardown ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop every worker and service (warmly, then SIGKILL), then remove the lab's namespaces."""
        for host in self.lab.hosts.values():  # a cut host cannot shut down warmly over its link
            with contextlib.suppress(Exception):
                host.link(up=True)
        stoppers = [threading.Thread(target=w.stop, kwargs={"timeout_s": 15}) for w in self.workers]
        for t in stoppers:  # warm shutdowns side by side: each takes a second or two
            t.start()
        for t in stoppers:
            t.join()
        for _, proc, log in reversed(self._procs):
            stop_process(proc, 10, kill_group=True)
            log.close()
        self._procs.clear()
        self.lab.close()

    def __enter__(self) -> HostFleet:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
