"""Per-path cost probes of the dispatch phase: the HTTP gateway's closed loop and the lone-request profile.

* :func:`measure_gateway` drives ``POST /v1/requests`` + ``GET /v1/requests/{id}`` (polled) against a
  ``fleet api`` subprocess and meters the gateway, Redis and the worker (CPU seconds, ``INFO
  commandstats`` deltas), like :mod:`bench.dispatch` does for the Python client.
* :func:`lone_profile` sends one request at a time through ``FleetClient`` and splits each round trip
  with the worker's own timings (``queue_wait_ms``, ``batch_wait_ms``, ``inference_ms``) into
  producer, broker wake-up + task start, batch window, engine, result publish + client wake-up; once
  waiting on the result backend's pub/sub (``result(wait=True)``) and once polling with ``MGET``
  (``wait``), so the client's wake-up is priced too.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from bench.load import run_threads
from bench.procs import metered
from bench.stats import RequestRecord, summarize_run
from producer.client import FleetClient
from protocol.messages import InferenceResult
from tools.processes import stop_process
from tools.redis_server import free_port

__all__ = ["GatewayServer", "lone_profile", "measure_gateway", "per_request"]

TERMINAL = {"succeeded", "failed", "cancelled", "expired"}
"""Gateway statuses after which a request's view no longer changes."""


class GatewayServer:
    """``fleet api`` in a subprocess on a free loopback port, bound to one config file."""

    def __init__(self, config: Path, log_path: Path) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log_path = log_path
        port = self.url.rsplit(":", 1)[1]
        cmd = [sys.executable, "-m", "producer.cli", "api", "--config", str(config), "--host", "127.0.0.1",
               "--port", port, "--no-access-log", "--log-level", "warning"]  # fmt: skip
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Return once ``/healthz`` answers 200.

        Raises:
            RuntimeError: the gateway exited, or did not answer within ``timeout_s`` seconds.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.proc.returncode}: see {self.log_path}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"gateway on {self.url} not ready within {timeout_s} s")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 15 s."""
        stop_process(self.proc, 15)


def _http_one(http: httpx.Client, model: str, ids: Sequence[int], poll_s: float,
              long_poll_s: float | None = None) -> tuple[RequestRecord, int]:  # fmt: skip
    """POST one request, then GET its view until terminal: polled from ``poll_s`` on (backing off), or,
    with ``long_poll_s``, long-polled (``?wait_s=``: the gateway answers when the result is stored).
    Returns (record, GETs it took). Never raises."""
    start = time.perf_counter()
    gets = 0
    try:
        resp = http.post("/v1/requests", json={"model": model, "input_ids": list(ids)})
        resp.raise_for_status()
        location = resp.headers["Location"]
        wait_s = poll_s
        while True:
            if long_poll_s is None:
                time.sleep(wait_s)
            gets += 1
            view = http.get(location, params={"wait_s": long_poll_s} if long_poll_s is not None else None).json()
            if view["status"] in TERMINAL:
                break
            wait_s = min(0.02, wait_s * 1.5)
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        return RequestRecord(start, time.perf_counter(), len(ids), error=f"{type(exc).__name__}: {exc}"), gets
    done = time.perf_counter()
    if view.get("result") is None:
        return RequestRecord(start, done, len(ids), error=str(view.get("error"))), gets
    return RequestRecord.from_result(start, done, InferenceResult.model_validate(view["result"])), gets


def per_request(cpu_s: dict[str, float], calls: dict[str, int], requests: int) -> dict[str, Any]:
    """CPU-ms and Redis commands per request from totals (``info``, the meter's own probe, left out)."""
    n = max(1, requests)
    per_call = {k: round(v / n, 2) for k, v in sorted(calls.items(), key=lambda kv: -kv[1]) if v > 0 and k != "info"}
    return {
        "cpu_ms_per_request": {k: round(1000 * v / n, 3) for k, v in cpu_s.items()},
        "redis_calls_per_request": per_call,
        "redis_calls_total_per_request": round(sum(per_call.values()), 2),
    }


def measure_gateway(
    gateway: GatewayServer, pids: dict[str, int], redis_url: str, model: str, prompts: Sequence[Sequence[int]], *,
    clients: int, duration_s: float, poll_s: float = 0.002, long_poll_s: float | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Closed loop of ``clients`` HTTP callers for ``duration_s`` seconds through ``gateway``.

    ``pids`` names the metered processes (gateway, redis, worker); the HTTP callers (this process)
    are not part of the fleet and are left out. A caller polls its request's view from ``poll_s``
    seconds on, backing off ×1.5 up to 20 ms, or with ``long_poll_s`` long-polls it (``GET
    …?wait_s=``, one GET unless the wait runs out): the GETs per request are reported.
    """
    records: list[RequestRecord] = []
    gets: Counter[str] = Counter()
    lock = threading.Lock()
    counter = iter(range(10**9))
    stop_at = float("inf")  # set when the callers start: the warm-up below may outlast a short window

    def loop() -> None:
        with httpx.Client(base_url=gateway.url, timeout=60) as http:
            first = True  # every caller completes one request, however late its thread starts
            while first or time.perf_counter() < stop_at:
                first = False
                with lock:
                    n = next(counter)
                rec, polls = _http_one(http, model, prompts[n % len(prompts)], poll_s, long_poll_s)
                with lock:
                    records.append(rec)
                    gets["polls"] += polls

    with httpx.Client(base_url=gateway.url, timeout=60) as http:  # warm the path (first model load etc.)
        for ids in prompts[:4]:
            _http_one(http, model, ids, poll_s, long_poll_s)
    stop_at = time.perf_counter() + duration_s
    _, cpu, calls = metered(pids, redis_url, lambda: run_threads(clients, loop, "bench-http"))
    summary = summarize_run(records)
    ok = [r for r in records if r.error is None]
    out = {
        "path": "gateway" if long_poll_s is None else "gateway-wait",
        "long_poll_s": long_poll_s,
        "clients": clients,
        "summary": summary.as_dict(),
        "errors": len(records) - len(ok),
        "polls_per_request": round(gets["polls"] / max(1, len(records)), 2),
        **per_request(cpu, calls, len(records)),
    }
    out["inference_ms_per_request"] = round(sum(r.inference_ms / max(1, r.batch_size) for r in ok) / max(1, len(ok)), 4)
    return out


def _median(values: Sequence[float]) -> float:
    return round(float(statistics.median(values)), 3) if values else float("nan")


def lone_profile(client: FleetClient, model: str, prompts: Sequence[Sequence[int]], *, requests: int,
                 bare_ms: float) -> dict[str, Any]:  # fmt: skip
    """Split ``requests`` lone round trips into their steps (medians, ms), for two ways of waiting.

    Steps: ``producer`` (build, admission, the script that claims the ID and queues the task:
    ``submit()`` returning), ``broker_and_task_start`` (queued → the request reaches the scheduler: the
    worker's ``BLMOVE`` wake-up and take script, decode, Celery's tracer), ``batch_window`` (the
    scheduler's wait for company), ``engine`` (``session.run``), ``result_and_wakeup`` (result stored
    and published → the caller has it). ``bare_ms`` is one bare ``session.run`` of the same model, for
    the overhead line.
    """
    out: dict[str, Any] = {"requests": requests, "bare_session_run_ms": round(bare_ms, 4)}
    for mode in ("pubsub", "poll"):
        steps: dict[str, list[float]] = {k: [] for k in
                                          ("producer", "broker_and_task_start", "batch_window", "engine",
                                           "result_and_wakeup", "total")}  # fmt: skip
        for i in range(requests):
            ids = prompts[i % len(prompts)]
            t0 = time.perf_counter()
            rid = client.submit(model, ids)
            t1 = time.perf_counter()
            if mode == "pubsub":
                result = client.result(rid, wait=True, timeout_s=60)
            else:
                got = client.wait([rid], timeout_s=60, poll_s=0.0005)[0]
                client.app.backend.result_consumer.cancel_for(rid)  # send_task subscribed it: don't pile up
                if not isinstance(got, InferenceResult):
                    raise got
                result = got
            t2 = time.perf_counter()
            assert result is not None
            t = result.timings
            total = 1000 * (t2 - t0)
            producer = 1000 * (t1 - t0)
            steps["producer"].append(producer)
            steps["broker_and_task_start"].append(t.queue_wait_ms - t.batch_wait_ms - producer)
            steps["batch_window"].append(t.batch_wait_ms)
            steps["engine"].append(t.inference_ms)
            steps["result_and_wakeup"].append(total - t.queue_wait_ms - t.inference_ms)
            steps["total"].append(total)
        medians = {k: _median(v) for k, v in steps.items()}
        medians["over_bare_ms"] = round(medians["total"] - bare_ms, 3)
        out[mode] = medians
    return out
