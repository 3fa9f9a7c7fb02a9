"""A ``bash`` driven one command at a time, like a reader typing into a terminal.

The shell keeps its variables and exports between commands; background jobs (``&``) stay in its process
group, which :meth:`Shell.close` ends (SIGTERM, then SIGKILL). Each command is written to a file and
``source``\\ d with stdin from ``/dev/null`` (so a command never swallows the next one), followed by a
sentinel line on stdout and stderr that carries its exit status.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tools.processes import die_with_parent

__all__ = ["CommandTimeout", "Ran", "Shell", "end_group"]

_SENTINEL = "\x1ereadme-done"


class CommandTimeout(TimeoutError):
    """A command did not finish within its limit (the shell is unusable afterwards)."""


@dataclass
class Ran:
    """What one command did."""

    rc: int
    stdout: str
    stderr: str
    seconds: float


def end_group(pgid: int, grace_s: float = 15.0, reap: Callable[[], object] | None = None) -> None:
    """SIGTERM process group ``pgid``, SIGKILL what is left after ``grace_s``, wait until it is gone.

    ``reap`` (e.g. the leader's ``Popen.poll``) collects our own child, which would otherwise linger as a
    zombie that still counts as a member of the group.
    """
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if reap is not None:
                reap()
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)


class _Reader(threading.Thread):
    """Collects one pipe's text; :meth:`until` waits for a sentinel and returns what came before it."""

    def __init__(self, pipe: IO[str]) -> None:
        super().__init__(daemon=True)
        self.pipe = pipe
        self.chunks: queue.Queue[str] = queue.Queue()
        self.buf = ""

    def run(self) -> None:
        for line in iter(self.pipe.readline, ""):
            self.chunks.put(line)
        self.chunks.put("")  # EOF

    def until(self, token: str, deadline: float) -> str | None:
        while token not in self.buf:
            try:
                chunk = self.chunks.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return None
            if chunk == "":
                return None
            self.buf += chunk
        before, _, self.buf = self.buf.partition(token)
        return before

    def rest(self) -> str:
        while not self.chunks.empty():
            self.buf += self.chunks.get_nowait()
        out, self.buf = self.buf, ""
        return out


class Shell:
    """One ``bash`` in its own process group, in ``cwd``, with ``env``; commands run one at a time."""

    def __init__(self, cwd: Path, env: dict[str, str], scratch: Path) -> None:
        self.scratch = scratch
        scratch.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            ["bash", "--noprofile", "--norc"], cwd=cwd, env=env, text=True, bufsize=1,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True, preexec_fn=die_with_parent,
        )
        assert self.proc.stdin and self.proc.stdout and self.proc.stderr
        self.stdin = self.proc.stdin
        self.out, self.err = _Reader(self.proc.stdout), _Reader(self.proc.stderr)
        self.out.start()
        self.err.start()
        self._n = 0

    def send(self, text: str) -> str:
        """Start ``text`` (returns at once); returns the token :meth:`wait` waits for."""
        self._n += 1
        path = self.scratch / f"cmd-{self._n}.sh"
        path.write_text(text + "\n")
        token = f"{_SENTINEL}-{self._n}"
        self.stdin.write(
            f"source {path} </dev/null\n"
            f"__readme_rc=$?; printf '\\n{token} %s\\x1e\\n' \"$__readme_rc\"; printf '\\n{token}\\x1e\\n' >&2\n"
        )
        self.stdin.flush()
        return token

    def wait(self, token: str, timeout_s: float) -> Ran:
        """Wait for the command behind ``token``.

        Raises:
            CommandTimeout: no sentinel within ``timeout_s`` (or the shell died).
        """
        started = time.monotonic()
        deadline = started + timeout_s
        out = self.out.until(token + " ", deadline)
        status = self.out.until("\x1e\n", deadline) if out is not None else None
        err = self.err.until(token + "\x1e\n", deadline) if status is not None else None
        if out is None or status is None or err is None:
            raise CommandTimeout(
                f"no end after {timeout_s:.0f} s; output so far:\n{(out or '') + self.out.rest()}\n"
                f"stderr:\n{self.err.rest()}"
            )
        return Ran(int(status), out.removesuffix("\n"), err.removesuffix("\n"), time.monotonic() - started)

    def run(self, text: str, timeout_s: float) -> Ran:
        return self.wait(self.send(text), timeout_s)

    def close(self) -> None:
        """End the shell and everything it started (its whole process group)."""
        with contextlib.suppress(OSError):
            self.stdin.close()
        end_group(self.proc.pid, reap=self.proc.poll)
        self.proc.wait(5)
