"""Load generators on the real path: FleetClient.submit → Redis → worker → FleetClient.result.

* :func:`closed_loop` — ``clients`` threads, each submitting its next request as soon as the
  previous result is in (saturation throughput; ``clients=1`` is the lone-request latency).
* :func:`open_loop` — Poisson arrivals at a set rate, independent of completions (latency under
  load); a pool of waiter threads collects each result as it becomes available.
* :func:`scheduled` — the open loop's engine: any request at any set of submit times (all at once
  included), each result collected as it becomes available.
* :func:`bulk_closed_loop` — like :func:`closed_loop`, but each client sends ``chunk`` requests per
  message through the fleet's bulk path (``FleetClient.submit_bulk`` → ``fleet.infer_bulk``) and
  waits for all of them (``FleetClient.wait``).

Latency is submit → result available, as the client sees it (``time.perf_counter``).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from bench.stats import RequestRecord, poisson_arrivals
from producer.client import FleetClient
from protocol.errors import FleetError
from protocol.messages import InferenceResult

__all__ = ["ClosedLoopRun", "bulk_closed_loop", "closed_loop", "open_loop", "run_threads", "scheduled"]

R = TypeVar("R")

RESULT_TIMEOUT_S = 120.0
"""Longest wait for one result before it counts as an error (s)."""


class ClosedLoopRun:
    """Records of a closed loop and its steady-state window (``perf_counter`` seconds)."""

    def __init__(self, records: list[RequestRecord], window: tuple[float, float] | None) -> None:
        self.records = records
        self.window = window


def run_threads(count: int, target: Callable[[], None], name: str) -> None:
    """Run ``target`` on ``count`` daemon threads named ``name-<i>`` and wait for all of them."""
    threads = [threading.Thread(target=target, name=f"{name}-{i}", daemon=True) for i in range(count)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()


def _one(client: FleetClient, model: str, ids: Sequence[int], top_k: int | None) -> RequestRecord:
    """Submit one request and wait for its result; never raises for a failed request."""
    start = time.perf_counter()
    try:
        rid = client.submit(model, ids, top_k=top_k)
        result = client.result(rid, wait=True, timeout_s=RESULT_TIMEOUT_S)
    except FleetError as exc:
        return RequestRecord(start, time.perf_counter(), len(ids), error=f"{type(exc).__name__}: {exc}")
    done = time.perf_counter()
    if result is None:  # pragma: no cover - wait=True returns a result or raises
        return RequestRecord(start, done, len(ids), error="no result")
    return RequestRecord.from_result(start, done, result)


def closed_loop(
    client: FleetClient,
    model: str,
    prompts: Sequence[Sequence[int]],
    *,
    clients: int,
    duration_s: float | None = None,
    warmup_s: float = 0.0,
    max_requests: int | None = None,
    top_k: int | None = None,
) -> ClosedLoopRun:
    """Run ``clients`` concurrent request loops.

    Stops after ``duration_s`` seconds (in-flight requests still complete; the window
    ``[start + warmup_s, start + duration_s]`` is returned for steady-state counting) or after
    ``max_requests`` requests in total (window None: everything counts). Prompts are taken in
    order, cycling.

    Raises:
        ValueError: neither or both of ``duration_s`` and ``max_requests`` are given.
    """
    if (duration_s is None) == (max_requests is None):
        raise ValueError("give exactly one of duration_s and max_requests")
    counter = itertools.count()
    lock = threading.Lock()
    records: list[RequestRecord] = []
    start = time.perf_counter()
    stop_at = start + duration_s if duration_s is not None else float("inf")

    def loop() -> None:
        while time.perf_counter() < stop_at:
            with lock:
                n = next(counter)
            if max_requests is not None and n >= max_requests:
                return
            rec = _one(client, model, prompts[n % len(prompts)], top_k)
            with lock:
                records.append(rec)

    run_threads(clients, loop, "bench-client")
    window = (start + warmup_s, stop_at) if duration_s is not None else None
    return ClosedLoopRun(sorted(records, key=lambda r: r.submit_s), window)


def open_loop(
    client: FleetClient,
    model: str,
    prompts: Sequence[Sequence[int]],
    *,
    rate_qps: float,
    duration_s: float,
    seed: int,
    waiters: int = 64,
    top_k: int | None = None,
) -> list[RequestRecord]:
    """Submit at Poisson arrival times of ``rate_qps`` for ``duration_s``; returns every record.

    A submit that falls behind its schedule goes out at once (arrivals never wait for
    completions). Results are collected by up to ``waiters`` threads.
    """
    arrivals = poisson_arrivals(rate_qps, duration_s, seed)

    def record(n: int, submitted: float, done: float, out: InferenceResult | FleetError) -> RequestRecord:
        if isinstance(out, InferenceResult):
            return RequestRecord.from_result(submitted, done, out)
        return RequestRecord(submitted, done, len(prompts[n % len(prompts)]), error=f"{type(out).__name__}: {out}")

    def submit(n: int) -> str:
        return client.submit(model, prompts[n % len(prompts)], top_k=top_k)

    return sorted(scheduled(client, arrivals, submit, record, waiters=waiters), key=lambda r: r.submit_s)


def scheduled(
    client: FleetClient,
    offsets: Sequence[float],
    submit: Callable[[int], str],
    record: Callable[[int, float, float, InferenceResult | FleetError], R],
    *,
    waiters: int = 64,
) -> list[R]:
    """Submit request ``n`` (``submit(n)`` returns its ID) at ``offsets[n]`` seconds from the start and
    collect each result on a pool of ``waiters`` threads as it becomes available.

    A submit that falls behind its schedule goes out at once (arrivals never wait for completions).
    Requests due at the same moment (a burst: equal offsets) are all submitted before their waits start:
    a wait started beside the submits would compete with them for this process's GIL (its short
    round trips hand the GIL back and forth), which stretched a 16-request burst's submits from ~20 ms
    to 50–170 ms and measured the client, not the fleet.
    Returns ``record(n, submitted_s, done_s, result or error)`` per request, in submit order; a
    refused submit is recorded with its error at once.
    """
    futures: list[Future[R]] = []
    refused: list[R] = []

    def wait_for(n: int, rid: str, submitted: float) -> R:
        try:
            result: InferenceResult | FleetError | None = client.result(rid, wait=True, timeout_s=RESULT_TIMEOUT_S)
        except FleetError as exc:
            result = exc
        if result is None:  # pragma: no cover - wait=True returns a result or raises
            result = FleetError("no result", "request_id", rid)
        return record(n, submitted, time.perf_counter(), result)

    with ThreadPoolExecutor(max_workers=waiters, thread_name_prefix="bench-waiter") as pool:
        start = time.perf_counter()
        n = 0
        while n < len(offsets):
            delay = start + offsets[n] - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            due: list[tuple[int, str, float]] = []
            while n < len(offsets) and start + offsets[n] <= time.perf_counter():  # every arrival due now
                submitted = time.perf_counter()
                try:
                    due.append((n, submit(n), submitted))
                except FleetError as exc:
                    refused.append(record(n, submitted, time.perf_counter(), exc))
                n += 1
            for i, rid, submitted in due:  # then their waits: a burst is submitted before any wait starts
                futures.append(pool.submit(wait_for, i, rid, submitted))
    return [f.result() for f in futures] + refused


def bulk_closed_loop(
    client: FleetClient,
    model: str,
    prompts: Sequence[Sequence[int]],
    *,
    clients: int,
    chunk: int,
    duration_s: float,
    top_k: int | None = None,
) -> ClosedLoopRun:
    """``clients`` threads, each sending ``chunk`` requests as one ``fleet.infer_bulk`` message and
    waiting for all of their results, for ``duration_s`` seconds.

    A request's latency is its chunk's submit → the moment the client had every result of the chunk.
    """
    counter = itertools.count()
    lock = threading.Lock()
    records: list[RequestRecord] = []
    stop_at = time.perf_counter() + duration_s

    def loop() -> None:
        while time.perf_counter() < stop_at:
            with lock:
                n = next(counter)
            seqs = [prompts[(n * chunk + j) % len(prompts)] for j in range(chunk)]
            start = time.perf_counter()
            try:
                results: list[InferenceResult | FleetError] = list(
                    client.wait(client.submit_bulk(model, seqs, chunk_size=chunk, top_k=top_k),
                                timeout_s=RESULT_TIMEOUT_S)
                )  # fmt: skip
            except FleetError as exc:
                results = [exc] * len(seqs)
            done = time.perf_counter()
            recs = [
                RequestRecord.from_result(start, done, r)
                if isinstance(r, InferenceResult)
                else RequestRecord(start, done, len(s), error=f"{type(r).__name__}: {r}")
                for r, s in zip(results, seqs, strict=True)
            ]
            with lock:
                records.extend(recs)

    run_threads(clients, loop, "bench-bulk")
    return ClosedLoopRun(sorted(records, key=lambda r: r.submit_s), None)
