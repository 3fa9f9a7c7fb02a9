"""The Celery floor's clients (:mod:`bench.celery_floor`): threads that each send ``floor.echo`` and wait for
its result, in a closed loop.

The worker process (``celery -A bench.celery_floor worker``) imports this module too: only Celery and the
standard library are imported here; the bench-side helpers (:mod:`bench.load`, :mod:`bench.stats`) inside
:func:`echo_loop`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

from celery import Celery

__all__ = ["ECHO_TASK", "RESULT_TIMEOUT_S", "EchoTarget", "echo_loop"]

ECHO_TASK = "floor.echo"
"""The one task: returns its single argument (a list of ints) unchanged."""

RESULT_TIMEOUT_S = 30.0
"""Longest wait for one result before it counts as an error (s)."""


class EchoTarget(Protocol):
    """Where the clients send: a producer app and the queue of the worker that serves ``floor.echo``
    (a :class:`bench.celery_floor.FloorWorker`)."""

    app: Celery
    queue: str


def echo_loop(worker: EchoTarget, prompts: Sequence[Sequence[int]], *, clients: int,
              duration_s: float | None = None, max_requests: int | None = None) -> list[Any]:  # fmt: skip
    """``clients`` threads, each sending ``floor.echo`` and waiting for its result, until ``duration_s``
    s have passed or ``max_requests`` were started; returns :class:`bench.stats.RequestRecord` s."""
    from bench.load import run_threads
    from bench.stats import RequestRecord

    lock = threading.Lock()
    records: list[RequestRecord] = []
    sent = 0
    stop_at = time.perf_counter() + duration_s if duration_s is not None else float("inf")

    def loop() -> None:
        nonlocal sent
        while time.perf_counter() < stop_at:
            with lock:
                n = sent
                sent += 1
            if max_requests is not None and n >= max_requests:
                return
            ids = list(prompts[n % len(prompts)])
            start = time.perf_counter()
            error: str | None = None
            try:
                out = worker.app.send_task(ECHO_TASK, args=[ids], queue=worker.queue).get(timeout=RESULT_TIMEOUT_S)
                if out != ids:
                    error = "echo returned something else"
            except Exception as exc:  # a failed request is counted, not fatal
                error = f"{type(exc).__name__}: {exc}"
            rec = RequestRecord(start, time.perf_counter(), len(ids), error=error)
            with lock:
                records.append(rec)

    run_threads(clients, loop, "floor-client")
    return records
