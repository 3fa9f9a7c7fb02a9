"""A load that sends one request every ``1 / rate_per_s`` seconds from a thread inside a lab host (a network
namespace, :mod:`tools.netns`) until stopped: the multi-host and partition tests' traffic. Subclasses say how
one request is sent (:meth:`PacedLoad.send`)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from typing import Any, Self

from tools.netns import NetHost

__all__ = ["PacedLoad", "Refused"]


class Refused(Exception):
    """A send the fleet refused, counted under ``reason`` (e.g. an HTTP status)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class PacedLoad:
    """Sends prompt ``i % prompts`` at ``rate_per_s`` (catching up at most 1 s after a stall) until :meth:`stop`."""

    def __init__(self, host: NetHost, prompts: int, rate_per_s: float, name: str) -> None:
        self.host, self.prompts, self.rate_per_s = host, prompts, rate_per_s
        self.accepted: list[tuple[str, int]] = []  # (request ID, prompt index)
        self.refused: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def send(self, n: int) -> str:
        """Send prompt ``n``; its request ID. Raises :class:`Refused` (or any error, counted by its type)."""
        raise NotImplementedError

    def session(self) -> contextlib.AbstractContextManager[Any]:
        """What the sending thread holds open while it sends (an HTTP client); nothing by default."""
        return contextlib.nullcontext()

    def start(self) -> Self:
        self._thread.start()
        return self

    def _run(self) -> None:
        self.host.enter()
        with self.session():
            next_t, i = time.monotonic(), 0
            while not self._stop.is_set():
                n = i % self.prompts
                try:
                    self.accepted.append((self.send(n), n))
                except Refused as refusal:
                    self.refused[refusal.reason] += 1
                except Exception as exc:  # counted: a refused submit is the caller's to see
                    self.refused[type(exc).__name__] += 1
                i += 1
                next_t = max(next_t + 1 / self.rate_per_s, time.monotonic() - 1.0)
                self._stop.wait(max(0.0, next_t - time.monotonic()))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    @property
    def ids(self) -> list[str]:
        return [rid for rid, _ in self.accepted]
