"""Starting and stopping real fleet processes (workers, Flower) for the demo, the bench and tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

import redis

from protocol.keys import WORKER_KEY_PREFIX
from tools.interrupts import forget_lost_interrupts, interrupt_was_lost, note_lost_interrupts

__all__ = ["WorkerProcess", "die_with_parent", "log_since", "poll_until", "stop_process", "stop_workers",
           "worker_command"]


def die_with_parent() -> None:
    """``preexec_fn``: on Linux, SIGKILL the child when the process that started it dies.

    The demo, the bench and the tests start workers in their own session (so Ctrl-C reaches the
    parent first and can shut them down warmly); without this a crashed parent would leave them running.
    Linux sends the signal when the *thread* that started the child exits: start children from a
    thread that outlives them (the main thread).
    """
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def stop_process(proc: subprocess.Popen[bytes], grace_s: float, *, kill_group: bool = False,
                 signalled: bool = False) -> None:  # fmt: skip
    """SIGTERM ``proc``, then SIGKILL it (its whole process group with ``kill_group``) after ``grace_s`` s.
    ``signalled``: it was sent SIGTERM already (a second one is not sent), only the wait and the kill remain."""
    if proc.poll() is not None:
        return
    if not signalled:
        proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        if kill_group:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
        proc.wait(10)


def log_since(path: Path, offset: int) -> str:
    """What a process wrote to its log file ``path`` from byte ``offset`` on (its own run's lines, when
    ``offset`` was the file's size as it started; undecodable bytes replaced)."""
    with open(path, "rb") as log:
        log.seek(offset)
        return log.read().decode(errors="replace")


def poll_until(check: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.05) -> Any:
    """Poll ``check()`` every ``poll_s`` s until it returns something truthy (returned).

    Raises:
        TimeoutError: still falsy after ``timeout_s`` s (the message names ``what``).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(poll_s)


_STOP_NOTED: list[signal.Signals] = []
"""Appended by the stop-signal handler of :func:`interrupt_on_stop_signals` (it outlives a dropped exception).
A plain list, not a lock-based event: the handler runs in the main thread between any two bytecodes,
also while that thread holds an event's lock."""


def stop_requested() -> bool:
    """Whether SIGINT or SIGTERM came since :func:`interrupt_on_stop_signals` set the handlers (its
    KeyboardInterrupt raised, or dropped in a finalizer: :func:`tools.interrupts.interrupt_was_lost`)."""
    return bool(_STOP_NOTED) or interrupt_was_lost()


def interrupt_on_stop_signals() -> None:
    """Make SIGINT and SIGTERM raise KeyboardInterrupt in this (main-thread) process, and note the request
    (:func:`stop_requested`).

    A foreground command (``fleet redis``, ``fleet store``) stops its server cleanly on Ctrl-C; but a
    process started asynchronously by a non-interactive shell (``cmd &`` in a script, CI) inherits
    SIGINT *ignored*, and Python then installs no handler at all, so Ctrl-C and ``kill -INT`` would do
    nothing. Setting the handlers explicitly makes both signals work however the command was started.
    Python runs a handler between bytecodes of whatever the main thread runs, finalizers included, and
    cannot raise from a weakref callback or a ``__del__``: such an interrupt is noted, not printed
    (:func:`tools.interrupts.note_lost_interrupts`), and a waiting loop stops on the note
    (:func:`serve_until_stopped`).
    """
    _STOP_NOTED.clear()
    forget_lost_interrupts()
    note_lost_interrupts()

    def _interrupt(signum: int, frame: object) -> None:
        _STOP_NOTED.append(signal.Signals(signum))
        raise KeyboardInterrupt(signal.Signals(signum).name)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)


STOP_CHECK_S = 0.2
"""How often :func:`serve_until_stopped` checks the server and the stop note (s)."""


def serve_until_stopped(ready: Callable[[], None], running: Callable[[], bool], stop: Callable[[], None]) -> None:
    """A foreground server command's life: ``ready()`` (print the line its callers wait for), then wait while
    ``running()`` (the server lives) until Ctrl-C or SIGTERM, then ``stop()``, always, once.

    The signal handlers are set before ``ready()``: a caller that acts on the printed line at once (a
    script's ``kill -INT``) may interrupt ``ready()`` itself, and still gets a clean stop and exit 0.
    A stop signal whose KeyboardInterrupt Python dropped (it landed in a finalizer) still stops the wait
    within :data:`STOP_CHECK_S`. Further stop signals are ignored while ``stop()`` runs.
    """
    interrupt_on_stop_signals()
    try:
        ready()
        while not stop_requested() and running():
            time.sleep(STOP_CHECK_S)
    except KeyboardInterrupt:
        pass
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        stop()
        forget_lost_interrupts()  # this stop was the one asked for: the command ends as it does on any stop


def worker_command(
    model: str, concurrency: int, hostname: str, queue: str, loglevel: str = "INFO", python: str | None = None
) -> list[str]:
    """The ``celery worker`` command line for one model (threads pool, events on)."""
    return [
        python or sys.executable,
        "-m",
        "celery",
        "-A",
        "workers.app",
        "worker",
        "-P",
        "threads",
        "-c",
        str(concurrency),
        "-Q",
        queue,
        "-n",
        hostname,
        "-E",
        "--loglevel",
        loglevel,
        "--without-gossip",
        "--without-mingle",
    ]


class WorkerProcess:
    """One ``celery worker`` subprocess serving one model.

    ``env`` is merged over the current environment (``FLEET_*`` settings go there). Output goes
    to ``log_path`` (or is discarded).
    """

    def __init__(
        self,
        *,
        model: str,
        queue: str,
        redis_url: str,
        concurrency: int = 8,
        hostname: str | None = None,
        env: dict[str, str] | None = None,
        log_path: Path | None = None,
        cwd: Path | None = None,
        python: str | None = None,
    ) -> None:
        self.model = model
        self.hostname = hostname or f"{model}-{os.getpid()}-{time.monotonic_ns() % 100000}@localhost"
        self.redis_url = redis_url
        self.env = {
            **os.environ,
            **(env or {}),
            "FLEET_REDIS_URL": redis_url,
            "FLEET_WORKER__MODEL": model,
            "FLEET_WORKER__CONCURRENCY": str(concurrency),
            "PYTHONUNBUFFERED": "1",
        }
        self.cmd = worker_command(model, concurrency, self.hostname, queue, python=python)
        self.log_path = log_path
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._terminated = False

    def start(self) -> WorkerProcess:
        """Spawn the worker (returns at once; see :meth:`wait_ready`)."""
        self._log = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115
        self._terminated = False
        self.proc = subprocess.Popen(
            self.cmd,
            env=self.env,
            cwd=self.cwd,
            stdout=self._log or subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        return self

    def wait_ready(self, timeout_s: float = 120.0) -> dict[str, object]:
        """Block until the worker's heartbeat says ready; returns that heartbeat.

        Raises:
            RuntimeError: the process exited first (its log tail is in the message).
            TimeoutError: not ready within ``timeout_s``.
        """
        client = redis.Redis.from_url(self.redis_url)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(
                        f"worker {self.hostname} exited with {self.proc.returncode}: {self.log_tail()}"
                    )
                raw = client.get(WORKER_KEY_PREFIX + self.hostname)
                if raw:
                    doc: dict[str, object] = json.loads(raw)
                    if doc.get("ready"):
                        return doc
                time.sleep(0.1)
        finally:
            client.close()
        raise TimeoutError(f"worker {self.hostname} not ready after {timeout_s} s: {self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the worker's log (empty when not logging to a file)."""
        if self.log_path and self.log_path.exists():
            return self.log_path.read_text(errors="replace")[-chars:]
        return ""

    def kill(self) -> None:
        """SIGKILL the worker (no graceful shutdown: its unacked requests go back after the visibility timeout)."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def terminate(self) -> None:
        """Begin a warm shutdown (SIGTERM) and return at once; :meth:`stop` then waits for it (several workers:
        :func:`stop_workers`)."""
        if self.proc and self.proc.poll() is None and not self._terminated:
            self.proc.terminate()
            self._terminated = True

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """Warm shutdown (SIGTERM: finish held requests, unless :meth:`terminate` sent it), SIGKILL after
        ``timeout_s``; returns the exit code."""
        if self.proc:
            stop_process(self.proc, timeout_s, kill_group=True, signalled=self._terminated)
        if self._log:
            self._log.close()
            self._log = None
        return self.proc.returncode if self.proc else None


def stop_workers(workers: Iterable[WorkerProcess], timeout_s: float = 15.0) -> None:
    """Warm-shut down ``workers`` side by side: SIGTERM to each, then wait for each (SIGKILL after ``timeout_s``)."""
    workers = list(workers)
    for w in workers:
        w.terminate()
    for w in workers:
        w.stop(timeout_s=timeout_s)
