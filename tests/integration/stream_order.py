"""Order evidence from Redis's own ``MONITOR`` that a token stream was read while its request still ran.

A reader's own clock cannot show it on a loaded machine: a starved client may parse its first chunk after the
worker finished. A stream reader is a generator its consumer pulls (the gateway's relay, the CLI's printer):
it asks for entries past the first ones only once it has handed those on, so such an ``XREAD`` before the
worker stores the final result shows the tokens were passed on while the request ran.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from types import TracebackType

from protocol.keys import STREAM_KEY

__all__ = ["Throttled", "asked_past_first", "ended", "relayed_before_stored"]


def ended(raw_meta: bytes | None) -> bool:
    """Whether a request's stored Celery meta (None: none) is its outcome. A generation stores STARTED as it
    begins: a test that took any stored meta for "finished" never saw one stopped mid-generation."""
    return raw_meta is not None and json.loads(raw_meta).get("status") in ("SUCCESS", "FAILURE", "REVOKED")


class Throttled:
    """A worker's process group slowed to a tenth of its speed (SIGCONT for ``run_s``, SIGSTOP for ``pause_s``, in
    turns, from a thread) until :meth:`stop` leaves it stopped; it runs freely again at exit.

    A test that stops a worker mid-generation once the first tokens are out had to win a race: a 256-token
    generation of the demo model takes ~0.2 s, and a test process starved beside a CPU hog read its first events
    after it had ended (in a fresh-clone run, five attempts in a row). Slowed, the generation lasts seconds;
    nothing waits on this clock: it only widens the window the test's event-driven steps land in."""

    def __init__(self, pgid: int, run_s: float = 0.003, pause_s: float = 0.027) -> None:
        self.pgid = pgid
        self.run_s, self.pause_s = run_s, pause_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._turns, daemon=True)

    def __enter__(self) -> Throttled:
        self._thread.start()
        return self

    def _turns(self) -> None:
        while not self._done.is_set():
            os.killpg(self.pgid, signal.SIGCONT)
            if self._done.wait(self.run_s):
                return
            os.killpg(self.pgid, signal.SIGSTOP)
            self._done.wait(self.pause_s)

    def _end_turns(self) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join(10)

    def stop(self) -> None:
        """End the turns and leave the worker stopped (SIGSTOP) until exit."""
        self._end_turns()
        os.killpg(self.pgid, signal.SIGSTOP)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._end_turns()
        os.killpg(self.pgid, signal.SIGCONT)


def asked_past_first(commands: list[str], rid: str) -> bool:
    """Whether a reader asked for the request's stream entries after one it had already received (an ``XREAD``
    naming the stream with a last ID past ``0-0``)."""
    stream = STREAM_KEY.format(id=rid)
    for command in commands:
        words = command.split(" ")
        if words[0] == "XREAD" and stream in words:
            keys = words[words.index("STREAMS") + 1 :]
            if keys[keys.index(stream) + len(keys) // 2] not in ("0", "0-0", "$"):
                return True
    return False


def relayed_before_stored(commands: list[str], rid: str) -> bool:
    """Whether, in Redis's own order of commands (``MONITOR``), a reader (the gateway's relay, the CLI) asked for
    the request's stream entries after one it had already received (:func:`asked_past_first`) before the worker
    stored the request's final result: tokens were passed on while it ran."""
    result = f"celery-task-meta-{rid}"
    stored = next(i for i, c in enumerate(commands) if result in c and '"status": "SUCCESS"' in c)
    return asked_past_first(commands[:stored], rid)
