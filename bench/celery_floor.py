"""The Celery floor: what stock Celery itself costs per request, with the fleet's delivery guarantees.

The fleet sends one Celery task per request (``fleet.infer``; :mod:`bench.dispatch` measures it on a
zero-cost identity model). Any Celery-per-request path that keeps the fleet's guarantees pays a floor
before any fleet code runs: a message per request (``LPUSH``/``BRPOP``), a late ack with kombu's
unacked bookkeeping (the visibility-timeout redelivery), a result stored under the task's ID and
announced to the waiting producer (``SET`` + ``PUBLISH``/``SUBSCRIBE``), and, with task events on,
an event per state change so that Flower sees every request (``PUBLISH``). This module measures that
floor with a stock Celery app and no fleet code: one task, ``floor.echo``, that returns its argument
(a list of ints) unchanged, configured like :func:`protocol.celeryconf.celery_config` (JSON only,
``acks_late``, ``reject_on_worker_lost``, prefetch 1, the threads pool at concurrency 16, results
in Redis for an hour, no STARTED state, no extended results).

:func:`measure_floor` runs a closed loop against one such worker and meters it exactly as
:mod:`bench.dispatch` meters the fleet: CPU milliseconds per request of the producer (this process),
Redis and the worker, and Redis commands per request (``INFO commandstats`` deltas). The difference
between the fleet's figures and these is what the fleet's own code costs per request.

Only Celery, kombu and redis-py are used here: nothing from ``protocol``, ``workers`` or
``producer``, whose :func:`broker.make_celery` installs a patched kombu channel process
wide. So that such a patch, installed earlier in the same bench process, cannot leak into the floor,
the app names its own transport (:class:`StockRedisTransport`): kombu's Redis transport with kombu's
own, unpatched channel. The bench-side helpers (:mod:`bench.procs`, :mod:`bench.stats`,
:mod:`tools.processes`) are imported inside the functions that run in the producer, so a worker
started with ``celery -A bench.celery_floor worker`` loads nothing but Celery, this module and its
clients' loop (:mod:`bench.celery_floor_loop`).

Run ``python -m bench.celery_floor`` for both variants (task events on and off) on a private Redis.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from celery import Celery
from celery.exceptions import TimeoutError as CeleryTimeoutError
from kombu.transport import redis as kombu_redis

from bench.celery_floor_loop import ECHO_TASK, echo_loop
from bench.celery_floor_loop import RESULT_TIMEOUT_S as RESULT_TIMEOUT_S  # re-exported: importable from here

__all__ = [
    "ECHO_TASK",
    "FloorRun",
    "FloorWorker",
    "StockRedisTransport",
    "app",
    "make_floor_app",
    "measure_floor",
]

CONCURRENCY = 16
"""Threads of the floor worker (the fleet's default worker concurrency)."""

REPO_ROOT = Path(__file__).resolve().parents[1]

MODULE = "bench.celery_floor"
"""This module's import name (``-A`` of the worker; not ``__name__``, which is ``__main__`` under ``-m``)."""

URL_ENV = "FLOOR_REDIS_URL"
"""Environment variable: the Redis URL (broker and result backend) of the module-level app."""

EVENTS_ENV = "FLOOR_EVENTS"
"""Environment variable: ``1`` = task events on (the worker also runs with ``-E``)."""


class StockRedisTransport(kombu_redis.Transport):
    """kombu's Redis transport with kombu's own channel class.

    :func:`broker.make_celery` (and the fleet worker) replace
    ``kombu.transport.redis.Transport.Channel`` in their process; this subclass pins the unpatched
    ``kombu.transport.redis.Channel``, so the floor stays stock even in a process that made a fleet client.
    """

    Channel = kombu_redis.Channel


def make_floor_app(redis_url: str, *, events: bool) -> Celery:
    """A stock Celery app on ``redis_url`` (broker and results), configured like the fleet's, with
    the ``floor.echo`` task.

    ``events``: the worker sends task events (``worker_send_task_events``; start it with ``-E`` too)
    and a producer sends a task-sent event per request (``task_send_sent_event``), as the fleet does
    so that Flower sees every request; False: both off.
    """
    floor = Celery("celery-floor", broker=redis_url, backend=redis_url, set_as_current=False)
    floor.conf.update(
        broker_transport=StockRedisTransport,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        event_serializer="json",
        result_expires=3600,
        result_extended=False,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_acks_on_failure_or_timeout=True,
        task_track_started=False,
        worker_prefetch_multiplier=1,
        worker_concurrency=CONCURRENCY,
        worker_pool="threads",
        worker_send_task_events=events,
        task_send_sent_event=events,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        broker_transport_options={"visibility_timeout": 3600},
    )

    @floor.task(name=ECHO_TASK, acks_late=True)  # type: ignore[untyped-decorator]
    def echo(ids: list[int]) -> list[int]:
        """The empty task: the request's token ids back, unchanged."""
        return ids

    return floor


app = make_floor_app(os.environ.get(URL_ENV, "redis://127.0.0.1:6379/0"), events=os.environ.get(EVENTS_ENV) == "1")
"""The app ``celery -A bench.celery_floor worker`` serves (Redis URL and events from the environment)."""


class FloorWorker:
    """One stock ``celery worker`` subprocess serving ``floor.echo`` from ``queue``, plus a producer
    app (same factory, same settings) in this process.

    Output goes to ``work_dir/logs/celery-floor-<queue>.log``.
    """

    def __init__(self, redis_url: str, queue: str, work_dir: Path, *, events: bool) -> None:
        self.redis_url = redis_url
        self.queue = queue
        self.events = events
        self.app = make_floor_app(redis_url, events=events)
        self.log_path = work_dir / "logs" / f"celery-floor-{queue}.log"
        hostname = f"{queue}-{os.getpid()}@localhost"
        self.cmd = [
            sys.executable, "-m", "celery", "-A", MODULE, "worker", "-P", "threads", "-c", str(CONCURRENCY),
            "-Q", queue, "-n", hostname, "--loglevel", "WARNING",
            "--without-gossip", "--without-mingle", "--without-heartbeat",
        ]  # fmt: skip
        if events:
            self.cmd.append("-E")
        self.env = {**os.environ, URL_ENV: redis_url, EVENTS_ENV: "1" if events else "0", "PYTHONUNBUFFERED": "1"}
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int:
        """Process id of the worker (started)."""
        assert self.proc is not None, "FloorWorker.start() first"
        return int(self.proc.pid)

    def start(self) -> FloorWorker:
        """Spawn the worker in its own session (returns at once; see :meth:`wait_ready`)."""
        from tools.processes import die_with_parent

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.cmd, env=self.env, cwd=REPO_ROOT, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=die_with_parent,
        )  # fmt: skip
        return self

    def wait_ready(self, timeout_s: float = 60.0) -> float:
        """Block until the worker has answered one ``floor.echo``; returns the seconds waited.

        The probe waits in the queue until the worker consumes it, so its result is the proof.

        Raises:
            RuntimeError: the worker exited first (its log tail is in the message).
            TimeoutError: no answer within ``timeout_s`` s.
        """
        began = time.monotonic()
        probe = self.app.send_task(ECHO_TASK, args=[[1, 2, 3]], queue=self.queue)
        while time.monotonic() - began < timeout_s:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"floor worker exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                if probe.get(timeout=0.5) == [1, 2, 3]:
                    return time.monotonic() - began
                raise RuntimeError(f"floor worker answered the probe wrongly: {self.log_tail()}")
            except CeleryTimeoutError:
                continue
        raise TimeoutError(f"floor worker on {self.queue!r} not ready after {timeout_s} s: {self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the worker's log."""
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def stop(self, grace_s: float = 20.0) -> int | None:
        """Warm shutdown (SIGTERM), SIGKILL of its process group after ``grace_s`` s; closes the
        producer app's connections. Returns the worker's exit code (None: never started)."""
        from tools.processes import stop_process

        try:
            if self.proc is not None:
                stop_process(self.proc, grace_s, kill_group=True)
        finally:
            if self._log is not None:
                self._log.close()
                self._log = None
            self.app.close()
        return self.proc.returncode if self.proc is not None else None


class FloorRun:
    """One floor variant measured in rounds, so that its rounds can be interleaved with other loops'
    (:func:`bench.dispatch.measure_dispatch` runs it between the fleet's variants in every round).

    :meth:`start` starts the worker and warms it up, :meth:`lone` sends requests one at a time,
    :meth:`measure_round` runs one metered closed loop, :meth:`result` condenses the rounds (see
    :func:`measure_floor`), :meth:`stop` stops the worker.
    """

    def __init__(self, redis_url: str, redis_pid: int, work_dir: Path, prompts: Sequence[Sequence[int]], *,
                 clients: int, events: bool) -> None:  # fmt: skip
        self.redis_url = redis_url
        self.redis_pid = redis_pid
        self.prompts = prompts
        self.clients = clients
        self.events = events
        self.queue = "floor-events" if events else "floor-lean"
        self.worker = FloorWorker(redis_url, self.queue, work_dir, events=events)
        self.cpu_s: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self.runs: list[tuple[list[Any], tuple[float, float]]] = []
        self.lone_records: list[Any] = []
        self.channel = ""

    def start(self) -> FloorRun:
        """Start the worker, wait until it answers, warm it up (``4 * clients`` requests, not counted)."""
        self.worker.start()
        self.worker.wait_ready()
        echo_loop(self.worker, self.prompts, clients=self.clients, max_requests=4 * self.clients)
        with self.worker.app.connection_for_write() as conn:  # the channel class the producer really uses
            channel = type(conn.default_channel)
        self.channel = f"{channel.__module__}.{channel.__qualname__}"
        return self

    def lone(self, requests: int) -> None:
        """``requests`` requests one at a time (their median round trip is ``lone_p50_ms``)."""
        self.lone_records += echo_loop(self.worker, self.prompts, clients=1, max_requests=requests)

    def measure_round(self, duration_s: float) -> None:
        """One closed loop of ``duration_s`` s, metered like the fleet's paths (:func:`bench.procs.metered`)."""
        from bench.procs import metered

        pids = {"producer": os.getpid(), "redis": self.redis_pid, "worker": self.worker.pid}
        start = time.perf_counter()
        records, cpu_s, calls = metered(pids, self.redis_url, lambda: echo_loop(
            self.worker, self.prompts, clients=self.clients, duration_s=duration_s))  # fmt: skip
        self.runs.append((records, (start, start + duration_s)))
        self.cpu_s.update(cpu_s)
        self.calls.update(calls)

    def stop(self) -> None:
        """Stop the worker (whatever happened)."""
        self.worker.stop()

    def result(self) -> dict[str, Any]:
        """The rounds' figures per request (see :func:`measure_floor`)."""
        from bench.stats import summarize_runs

        summary = summarize_runs(self.runs)
        n = max(1, summary.requests)
        per_process = {name: 1000 * s / n for name, s in self.cpu_s.items()}
        per_call = {k: v / n for k, v in self.calls.items() if v > 0 and k != "info"}  # "info": our own probe
        label = "stock Celery, empty task: acks_late, result by ID, " + (
            "task events + sent events (Flower sees every request)" if self.events else "no task events"
        )
        out: dict[str, Any] = {
            "label": label,
            "events": self.events,
            "queue": self.queue,
            "clients": self.clients,
            "rounds": len(self.runs),
            "channel": self.channel,
            "summary": {
                "requests": summary.requests,
                "errors": summary.errors,
                "qps": round(summary.qps, 1),
                "p50_ms": round(summary.latency.p50_ms, 3),
                "p99_ms": round(summary.latency.p99_ms, 3),
            },
            "cpu_ms_per_request": {k: round(v, 3) for k, v in per_process.items()},
            "cpu_ms_total_per_request": round(sum(per_process.values()), 3),
            "redis_calls_per_request": {k: round(v, 2) for k, v in sorted(per_call.items(), key=lambda kv: -kv[1])},
            "redis_calls_total_per_request": round(sum(per_call.values()), 2),
        }
        ok_lone = [r.latency_ms for r in self.lone_records if r.error is None]
        if self.lone_records:
            out["lone_p50_ms"] = round(statistics.median(ok_lone), 3) if ok_lone else float("nan")
        return out


def measure_floor(
    redis_url: str,
    redis_pid: int,
    work_dir: Path,
    prompts: Sequence[Sequence[int]],
    *,
    clients: int,
    duration_s: float,
    rounds: int,
    events: bool,
    lone_requests: int = 0,
) -> dict[str, Any]:
    """The Celery floor: a closed loop of ``clients`` threads against one stock worker of ``floor.echo``.

    Starts a :class:`FloorWorker` on its own queue (``floor-events`` or ``floor-lean``), warms it up
    (``4 * clients`` requests), sends ``lone_requests`` requests one at a time (median round trip,
    ``lone_p50_ms``), then runs ``rounds`` closed loops of ``duration_s / rounds`` s each, metered as
    :func:`bench.dispatch._metered` meters the fleet: CPU seconds of the producer (this process), Redis
    (``redis_pid``) and the worker, and Redis calls (``INFO commandstats``, our own ``info`` dropped).
    Requests are counted when they complete inside a loop's window.

    Returns a dict: ``label``, ``events``, ``summary`` (``requests``, ``errors``, ``qps`` = counted
    requests / s of the windows, ``p50_ms``/``p99_ms`` = send → result latency), ``cpu_ms_per_request``
    per process and its total (CPU ms per counted request), ``redis_calls_per_request`` per command
    (descending) and its total, and ``lone_p50_ms`` (ms) when ``lone_requests`` > 0.
    The worker is stopped whatever happens.
    """
    run = FloorRun(redis_url, redis_pid, work_dir, prompts, clients=clients, events=events)
    try:
        run.start()
        if lone_requests > 0:
            run.lone(lone_requests)
        for _ in range(rounds):
            run.measure_round(duration_s / rounds)
    finally:
        run.stop()
    return run.result()


def main() -> None:
    """Both variants (events on, then off) on a private Redis; prints their figures as JSON."""
    from bench.procs import flush_redis
    from tools.calibration import synthetic_sequences
    from tools.redis_server import EmbeddedRedis

    prompts = synthetic_sequences(256, vocab_size=1000, min_tokens=8, max_tokens=16, seed=101)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="celery-floor-") as tmp, EmbeddedRedis() as server:
        assert server.proc is not None
        for events in (True, False):
            flush_redis(server.url)
            key = "events" if events else "lean"
            results[key] = measure_floor(server.url, server.proc.pid, Path(tmp), prompts, clients=16,
                                         duration_s=6.0, rounds=2, events=events, lone_requests=100)  # fmt: skip
            print(f"[floor] {key}: {results[key]['summary']['qps']} req/s, "
                  f"{results[key]['cpu_ms_total_per_request']} CPU-ms/request", file=sys.stderr)  # fmt: skip
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
