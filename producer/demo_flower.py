"""Flower for ``fleet demo``: started on a free loopback port with a one-run password, waited for while it
comes up, and started again on another port when a process bound the first one before Flower did.

A free port is free only until another process binds it (a server, a client's outgoing connection), so
a Flower that exits saying its address is in use is started again on a new pick (up to
:data:`~tools.redis_server.PORT_PICKS`). A Flower that exits for another reason ends the wait at once (not
after its 30 s) and the demo goes on without it, naming its log.
"""

from __future__ import annotations

import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from tools.processes import die_with_parent, log_since, stop_process
from tools.redis_server import PORT_PICKS, free_port

__all__ = ["DemoFlower"]

USER = "fleet"
"""The basic-auth user of the demo's Flower (its password is made per run)."""


class DemoFlower:
    """One ``celery flower`` subprocess for the demo (:meth:`start`, :meth:`wait_up`, :meth:`stop`)."""

    def __init__(self, redis_url: str, logdir: Path) -> None:
        self.redis_url = redis_url
        self.log_path = logdir / "flower.log"
        self.auth = (USER, secrets.token_urlsafe(12))
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_from = 0
        self._picks = PORT_PICKS

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> DemoFlower:
        """Start Flower on a newly picked port (returns at once; :meth:`wait_up` waits for it)."""
        self._picks -= 1
        self.port = free_port()
        self._log_from = self.log_path.stat().st_size if self.log_path.exists() else 0
        cmd = [sys.executable, "-m", "producer.flower_main",  # celery flower, with a SIGTERM that always stops it
               "-b", self.redis_url, "flower", f"--port={self.port}", "--address=127.0.0.1",
               f"--basic-auth={self.auth[0]}:{self.auth[1]}"]  # fmt: skip
        with open(self.log_path, "ab") as log:  # the child holds its own copy of the descriptor
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=die_with_parent)  # fmt: skip
        return self

    def wait_up(self, say: Callable[[str], None], timeout_s: float = 30.0) -> bool:
        """Wait until Flower's API answers (True), up to ``timeout_s``; a Flower whose port was taken is started
        on another. False, said through ``say``, when it exited for another reason or did not answer in time."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None, "start() first"
            if self.proc.poll() is not None:
                said = log_since(self.log_path, self._log_from)
                if "address already in use" in said.lower() and self._picks > 0:
                    self.start()
                    continue
                say(f"Flower exited with {self.proc.returncode} (its log: {self.log_path}); the demo goes on "
                    "without it")
                return False
            try:
                if httpx.get(self.url + "/api/workers", auth=self.auth, timeout=2).status_code < 500:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        say(f"Flower did not answer on {self.url} within {timeout_s:.0f} s (its log: {self.log_path})")
        return False

    def stop(self) -> None:
        """SIGTERM Flower (SIGKILL after 15 s)."""
        if self.proc is not None:
            stop_process(self.proc, 15)
