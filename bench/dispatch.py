"""Dispatch cost: a zero-cost model through the full path, so the queue's own overhead is visible.

The identity model (one ``OneHot`` node) stands in for inference. For a closed loop against one
worker it measures requests/s, the CPU milliseconds each process spends per request (producer =
this bench process, Redis, worker) minus the engine's own time, and the Redis commands each
request costs. With py-spy installed it also samples where the worker's and the producer's CPU goes.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.bulk_prototype import bulk_closed_loop
from bench.load import closed_loop
from bench.procs import CpuMeter, FleetConfig, RunningFleet, redis_commandstats
from bench.profile import fold_components, parse_raw, py_spy_path, record, top_functions
from bench.stats import RequestRecord, summarize_run

__all__ = ["measure_dispatch"]


def _inference_ms_per_request(records: Sequence[RequestRecord]) -> float:
    ok = [r for r in records if r.error is None and r.batch_size > 0]
    return sum(r.inference_ms / r.batch_size for r in ok) / max(1, len(ok))


def _cost_run(
    client: Any,
    fleet: RunningFleet,
    redis_pid: int,
    redis_url: str,
    model: str,
    prompts: Sequence[Sequence[int]],
    *,
    clients: int,
    duration_s: float,
    bulk_chunk: int = 0,
) -> dict[str, Any]:
    """One closed loop with CPU meters and Redis command counters around it.

    ``bulk_chunk`` > 0 drives the bulk-path prototype instead: ``bulk_chunk`` requests per message.
    """
    meter = CpuMeter({"producer": os.getpid(), "redis": redis_pid, "worker": fleet.pid})
    calls_before = redis_commandstats(redis_url)
    if bulk_chunk > 0:
        run = bulk_closed_loop(client, model, prompts, clients=clients, chunk=bulk_chunk, duration_s=duration_s)
    else:
        run = closed_loop(client, model, prompts, clients=clients, duration_s=duration_s)
    cpu_s = meter.elapsed()
    calls_after = redis_commandstats(redis_url)
    summary = summarize_run(run.records)  # every request, first submit → last result
    n = max(1, summary.requests)
    infer_ms = _inference_ms_per_request(run.records)
    per_process = {name: 1000 * s / n for name, s in cpu_s.items()}
    calls = {k: (v - calls_before.get(k, 0)) / n for k, v in calls_after.items() if v - calls_before.get(k, 0) > 0}
    calls.pop("info", None)  # our own INFO probe
    return {
        "clients": clients,
        "requests_per_message": bulk_chunk or 1,
        "summary": summary.as_dict(),
        "cpu_ms_per_request": {k: round(v, 3) for k, v in per_process.items()},
        "inference_ms_per_request": round(infer_ms, 4),
        "cpu_ms_outside_inference": round(sum(per_process.values()) - infer_ms, 3),
        "redis_calls_per_request": {k: round(v, 2) for k, v in sorted(calls.items(), key=lambda kv: -kv[1])},
        "redis_calls_total_per_request": round(sum(calls.values()), 2),
    }


def _profile(
    client: Any,
    fleet: RunningFleet,
    model: str,
    prompts: Sequence[Sequence[int]],
    *,
    clients: int,
    duration_s: float,
) -> dict[str, Any]:
    """Sample the worker and this producer with py-spy during a closed loop."""
    if py_spy_path() is None:
        return {"status": "skipped: py-spy is not installed (pip install py-spy)"}
    with tempfile.TemporaryDirectory(prefix="fleet-profile-") as tmp:
        files = {"worker": Path(tmp) / "worker.txt", "producer": Path(tmp) / "producer.txt"}
        spies = {
            "worker": record(fleet.pid, duration_s, files["worker"]),
            "producer": record(os.getpid(), duration_s, files["producer"]),
        }
        closed_loop(client, model, prompts, clients=clients, duration_s=duration_s + 0.5)
        out: dict[str, Any] = {"status": "ok", "duration_s": duration_s}
        for name, spy in spies.items():
            spy.wait(60)
            if not files[name].exists():
                out[name] = {"status": f"py-spy wrote nothing (exit {spy.returncode}; needs ptrace permission)"}
                continue
            stacks = parse_raw(files[name].read_text())
            total, shares = fold_components(stacks)
            out[name] = {
                "samples": total,
                "components": {k: round(v, 4) for k, v in shares.items() if v > 0},
                "top_functions": [(f, round(s, 4)) for f, s in top_functions(stacks, 12)],
            }
    return out


def measure_dispatch(
    config: FleetConfig,
    redis_url: str,
    redis_pid: int,
    work_dir: Path,
    prompts: Sequence[Sequence[int]],
    *,
    clients: int,
    duration_s: float,
    lone_requests: int,
    ablations: dict[str, tuple[str, FleetConfig]] | None = None,
    profile_s: float = 0.0,
    say: Any = None,
) -> dict[str, Any]:
    """Dispatch-cost figures for ``config`` (an identity model): see the module docstring.

    ``ablations`` (key → (label, variant of ``config``), e.g. Celery log level INFO, ``lean=True``,
    ``bulk=True``) each get the same loop, one after the other; ``profile_s`` > 0 adds a py-spy profile of the main
    configuration.
    """
    log = say or (lambda msg: print(msg, file=sys.stderr))
    out: dict[str, Any] = {
        "model": config.model_name,
        "max_batch_size": config.max_batch_size,
        "concurrency": config.concurrency,
        "celery_loglevel": config.celery_loglevel,
        "ablations": {},
    }
    fleet = RunningFleet(config, redis_url, work_dir)
    client = fleet.start()
    try:
        closed_loop(client, config.model_name, prompts, clients=clients, max_requests=4 * clients)  # warm
        lone = closed_loop(client, config.model_name, prompts, clients=1, max_requests=lone_requests)
        out["lone"] = summarize_run(lone.records).as_dict()
        log(f"dispatch: lone round trip p50 {out['lone']['latency']['p50_ms']:.2f} ms")
        out["loop"] = _cost_run(
            client, fleet, redis_pid, redis_url, config.model_name, prompts, clients=clients, duration_s=duration_s
        )
        log(
            f"dispatch: {out['loop']['summary']['qps']:.0f} req/s, "
            f"{out['loop']['cpu_ms_outside_inference']:.2f} CPU-ms/request outside inference"
        )
        if profile_s > 0:
            out["profile"] = _profile(client, fleet, config.model_name, prompts, clients=clients, duration_s=profile_s)
    finally:
        fleet.stop()
    for key, (name, variant) in (ablations or {}).items():
        fleet = RunningFleet(variant, redis_url, work_dir)
        client = fleet.start()
        try:
            closed_loop(client, variant.model_name, prompts, clients=clients, max_requests=4 * clients)
            lone = closed_loop(client, variant.model_name, prompts, clients=1, max_requests=lone_requests)
            chunk = variant.max_batch_size if variant.bulk else 0
            loop = _cost_run(
                client,
                fleet,
                redis_pid,
                redis_url,
                variant.model_name,
                prompts,
                clients=max(1, clients // chunk) if chunk else clients,
                duration_s=duration_s,
                bulk_chunk=chunk,
            )
            out["ablations"][key] = {"label": name, "lone": summarize_run(lone.records).as_dict(), "loop": loop}
            log(
                f"dispatch ({name}): {loop['summary']['qps']:.0f} req/s, "
                f"{loop['cpu_ms_outside_inference']:.2f} CPU-ms/request outside inference"
            )
        finally:
            fleet.stop()
    return out
