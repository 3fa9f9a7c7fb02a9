"""The peer's own virtual environment and worker process (see :mod:`bench.peer_celery_batches`).

celery-batches 0.11 pins Celery < 5.7, so the peer cannot share the fleet's environment. The
bench creates ``var/peer-venv`` once (``python -m venv`` + ``pip install``, about 20 s with a
warm pip cache) and reuses it afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import redis

__all__ = ["PEER_REQUIREMENTS", "PeerUnavailable", "PeerWorker", "ensure_peer_venv"]

PEER_REQUIREMENTS = ("celery[redis]<5.7", "celery-batches==0.11", "onnxruntime", "numpy")
"""What the peer's environment holds (its Celery is the newest celery-batches accepts)."""
_PROBE = "import celery, celery_batches, onnxruntime, numpy, redis; print(celery.__version__)"


class PeerUnavailable(RuntimeError):
    """The peer's environment could not be created (offline, pip failed); the row is skipped."""


def _python_of(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _probe(python: Path) -> str | None:
    """Celery version of the environment, or None when it lacks a requirement."""
    if not python.exists():
        return None
    done = subprocess.run([str(python), "-c", _PROBE], capture_output=True, text=True, timeout=120, check=False)
    return done.stdout.strip() if done.returncode == 0 else None


def ensure_peer_venv(venv: Path, *, progress: bool = True, timeout_s: float = 900.0) -> tuple[Path, str]:
    """The peer environment's Python and its Celery version, creating the environment if needed.

    Raises:
        PeerUnavailable: ``venv`` or ``pip install`` failed (the message holds pip's last lines).
    """
    venv = venv.absolute()  # not resolve(): the venv's python is a symlink that must stay one
    python = _python_of(venv)
    version = _probe(python)
    if version:
        return python, version
    if progress:
        print(
            f"[bench] creating the peer's environment {venv} ({', '.join(PEER_REQUIREMENTS)})",
            file=sys.stderr,
        )
    base = getattr(sys, "_base_executable", sys.executable)
    steps = [
        [base, "-m", "venv", "--clear", str(venv)],
        [str(python), "-m", "pip", "install", "--quiet", *PEER_REQUIREMENTS],
    ]
    for cmd in steps:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise PeerUnavailable(f"{' '.join(cmd[:4])} failed: {exc}") from exc
        if done.returncode != 0:
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
            raise PeerUnavailable(f"{' '.join(cmd[:4])} exited {done.returncode}: {tail}")
    version = _probe(python)
    if not version:
        raise PeerUnavailable(f"{venv} was created but cannot import the peer's requirements")
    return python, version


class PeerWorker:
    """One celery-batches worker subprocess serving ``model_path`` from ``queue``."""

    def __init__(
        self,
        *,
        python: Path,
        model_path: Path,
        queue: str,
        redis_url: str,
        flush_every: int,
        flush_interval_s: float,
        max_tokens: int,
        log_path: Path,
    ) -> None:
        self.hostname = f"peer-{os.getpid()}-{time.monotonic_ns() % 100000}@localhost"
        self.redis_url = redis_url
        self.cmd = [
            str(python),
            "-m",
            "celery",
            "-A",
            "peer_celery_batches",
            "worker",
            "-P",
            "threads",
            "-c",
            "1",
            "--prefetch-multiplier",
            "64",
            "-Q",
            queue,
            "-n",
            self.hostname,
            "--loglevel",
            "WARNING",
            "--without-gossip",
            "--without-mingle",
        ]
        # A clean environment: nothing of this project's virtualenv may leak into the peer's.
        keep = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "OMP_NUM_THREADS")
        self.env = {k: os.environ[k] for k in keep if k in os.environ}
        self.env.update(
            PEER_REDIS_URL=redis_url,
            PEER_MODEL_PATH=str(model_path.resolve()),
            PEER_FLUSH_EVERY=str(flush_every),
            PEER_FLUSH_INTERVAL_S=str(flush_interval_s),
            PEER_MAX_TOKENS=str(max_tokens),
            PYTHONUNBUFFERED="1",
        )
        self.cwd = Path(__file__).resolve().parent
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int:
        """Process id of the peer worker."""
        assert self.proc is not None
        return int(self.proc.pid)

    def spawn(self) -> None:
        """Start the worker process (returns at once; see :meth:`wait_ready`)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.cmd, cwd=self.cwd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        """Block until the worker's ready key appears (model loaded and warmed up).

        Raises:
            RuntimeError: it exited first; TimeoutError: not ready within ``timeout_s``.
        """
        assert self.proc is not None, "spawn() first"
        client = redis.Redis.from_url(self.redis_url)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    tail = self.log_path.read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"peer worker exited with {self.proc.returncode}: {tail}")
                raw = client.get(f"bench:peer:ready:{self.hostname}")
                if raw and json.loads(raw).get("pid"):
                    return
                time.sleep(0.1)
        finally:
            client.close()
        raise TimeoutError(f"peer worker not ready after {timeout_s} s")

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM (warm shutdown), SIGKILL after ``timeout_s``."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if self._log is not None:
            self._log.close()
            self._log = None
