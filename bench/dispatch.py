"""Dispatch cost: a zero-cost model through the full path, so the queue's own overhead is visible.

The identity model (one ``OneHot`` node) stands in for inference. For a closed loop against one
worker it measures requests/s, the CPU milliseconds each process spends per request (producer =
this bench process, Redis, worker) minus the engine's own time, and the Redis commands each
request costs. Variants (Celery log level, lean Celery, the bulk path) run side by side:
every variant's worker is started at once, each on its own queue, and the loops visit them in
interleaved rounds (:func:`dispatch_variants`: one per Celery extra turned off, all off, the bulk
path). With py-spy installed it also samples where the worker's and the producer's CPU goes.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.celery_floor import FloorRun
from bench.load import ClosedLoopRun, bulk_closed_loop, closed_loop
from bench.plan import Plan
from bench.procs import FleetConfig, RunningFleet, metered
from bench.profile import fold_components, parse_raw, py_spy_path, record, top_functions
from bench.stats import RequestRecord, summarize_run, summarize_runs

__all__ = ["EXTRAS_OFF", "Variant", "dispatch_variants", "measure_dispatch"]

Variant = tuple[str, FleetConfig, int]
"""(label, worker configuration, requests per message: 1 = one ``fleet.infer`` task per request,
more = ``fleet.infer_bulk`` messages of that many requests)."""


EXTRAS_OFF = {"task_events": False, "sent_events": False, "track_started": False, "result_extended": False}
"""The ``celery`` settings of the lean variant: every per-task extra of protocol/celeryconf.py off."""


def dispatch_variants(plan: Plan, name: str, path: Path) -> dict[str, Variant]:
    """The identity-model worker as served, and (full plan) one variant per Celery extra toggled, all of them
    off, the bulk path, and the bulk path with every extra off."""
    cfg = FleetConfig(
        label="dispatch",
        model_name=f"{name}-served",
        model_path=path,
        max_batch_size=plan.concurrency,
        max_wait_ms=plan.max_wait_ms,
        concurrency=plan.concurrency,
        celery_loglevel="WARNING",
    )
    out: dict[str, Variant] = {"served": ("as served (Celery log level WARNING)", cfg, 1)}
    changes: dict[str, tuple[str, dict[str, bool], int]] = {
        "no-events": (
            "no task events (`celery.task_events` and `celery.sent_events` false, worker without -E)",
            {"task_events": False, "sent_events": False},
            1,
        ),
        "started": ("STARTED stored for every request (`celery.track_started: true`)", {"track_started": True}, 1),
        "lean": ("lean Celery: no task events, no STARTED state, no extended result", EXTRAS_OFF, 1),
        "bulk": (f"bulk path (`fleet.infer_bulk`): {plan.concurrency} requests per message", {}, plan.concurrency),
        "bulk+lean": (f"bulk path ({plan.concurrency} per message) + lean Celery", EXTRAS_OFF, plan.concurrency),
    }
    for key, (label, celery, per_message) in changes.items():
        if plan.ablations or key == "bulk":
            slug = key.replace("+", "-")
            variant = replace(cfg, label=f"dispatch-{slug}", model_name=f"{name}-{slug}", celery=celery)
            out[key] = (label, variant, per_message)
    return out


class _Tally:
    """CPU seconds, Redis calls and records of one variant, summed over its rounds."""

    def __init__(self) -> None:
        self.cpu_s: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self.runs: list[ClosedLoopRun] = []

    def result(self, clients: int, per_message: int) -> dict[str, Any]:
        """The variant's figures per request (``per_message`` > 1: sent through ``fleet.infer_bulk``)."""
        summary = summarize_runs([(run.records, None) for run in self.runs])
        records = [r for run in self.runs for r in run.records if r.error is None and r.batch_size > 0]
        n = max(1, summary.requests)
        infer_ms = sum(r.inference_ms / r.batch_size for r in records) / max(1, len(records))
        per_process = {name: 1000 * s / n for name, s in self.cpu_s.items()}
        calls = {k: v / n for k, v in self.calls.items() if v > 0 and k != "info"}  # "info": our own probe
        return {
            "clients": clients,
            "requests_per_message": per_message,
            "path": "fleet.infer_bulk" if per_message > 1 else "fleet.infer",
            "summary": summary.as_dict(),
            "cpu_ms_per_request": {k: round(v, 3) for k, v in per_process.items()},
            "inference_ms_per_request": round(infer_ms, 4),
            "cpu_ms_outside_inference": round(sum(per_process.values()) - infer_ms, 3),
            "redis_calls_per_request": {k: round(v, 2) for k, v in sorted(calls.items(), key=lambda kv: -kv[1])},
            "redis_calls_total_per_request": round(sum(calls.values()), 2),
        }


def _metered(tally: _Tally, pids: dict[str, int], redis_url: str, run: Callable[[], ClosedLoopRun]) -> None:
    result, cpu_s, calls = metered(pids, redis_url, run)
    tally.cpu_s.update(cpu_s)
    tally.calls.update(calls)
    tally.runs.append(result)


def _profile(client: Any, fleet: RunningFleet, model: str, prompts: Sequence[Sequence[int]], *, clients: int,
             duration_s: float) -> dict[str, Any]:  # fmt: skip
    """Sample the worker and this producer with py-spy (``--gil``) during a closed loop."""
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


def _loop_runner(client: Any, model: str, prompts: Sequence[Sequence[int]], chunk: int, clients: int,
                 seconds: float) -> Callable[[], ClosedLoopRun]:  # fmt: skip
    """One metered closed loop of ``seconds`` s: ``fleet.infer`` (``chunk`` 1) or ``fleet.infer_bulk``."""

    def run() -> ClosedLoopRun:
        if chunk > 1:
            n = max(2, 2 * clients // chunk)  # a chunk waits for its slowest request
            return bulk_closed_loop(client, model, prompts, clients=n, chunk=chunk, duration_s=seconds)
        return closed_loop(client, model, prompts, clients=clients, duration_s=seconds)

    return run


def _variant_results(variants: dict[str, Variant], per_message: dict[str, int], lone: dict[str, list[RequestRecord]],
                     tallies: dict[str, _Tally], clients: int, log: Any) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Each variant's label, lone-request summary and closed-loop figures per request."""
    results: dict[str, dict[str, Any]] = {}
    for key in tallies:
        chunk = per_message[key]
        results[key] = {
            "label": str(variants[key][0]),
            "lone": summarize_run(lone[key]).as_dict(),
            "loop": tallies[key].result(max(2, 2 * clients // chunk) if chunk > 1 else clients, chunk),
        }
        loop = results[key]["loop"]
        log(f"dispatch ({variants[key][0]}): {loop['summary']['qps']:.0f} req/s, "
            f"{loop['cpu_ms_outside_inference']:.2f} CPU-ms/request outside inference")  # fmt: skip
    return results


def measure_dispatch(
    variants: dict[str, Variant],
    redis_url: str,
    redis_pid: int,
    work_dir: Path,
    prompts: Sequence[Sequence[int]],
    *,
    clients: int,
    duration_s: float,
    lone_requests: int,
    rounds: int = 1,
    profile_s: float = 0.0,
    say: Any = None,
    floors: Sequence[bool] = (),
) -> dict[str, Any]:
    """Dispatch-cost figures for each variant (key → (label, config of an identity model, requests
    per message)).

    The first variant is the fleet as served: its figures are the top level of the result, the
    others go under ``"ablations"``; ``profile_s`` > 0 adds a py-spy profile of the first. A variant
    of more than one request per message is driven through the fleet's bulk path (``fleet.infer_bulk``).
    ``floors`` (events on/off, one each) adds stock Celery's empty task (:mod:`bench.celery_floor`), its
    rounds interleaved with the variants', under ``"floor"`` (``"events"``, ``"lean"``).
    """
    log = say or (lambda msg: print(msg, file=sys.stderr))
    fleets = {key: RunningFleet(cfg, redis_url, work_dir) for key, (_, cfg, _) in variants.items()}
    per_message = {key: chunk for key, (_, _, chunk) in variants.items()}
    floor_runs = {("events" if events else "lean"): FloorRun(redis_url, redis_pid, work_dir, prompts,
                                                              clients=clients, events=events)
                  for events in floors}  # fmt: skip
    for fleet in fleets.values():
        fleet.spawn()
    try:
        for floor in floor_runs.values():
            floor.start()
        clients_of = {k: fl.ready() for k, fl in fleets.items()}
        lone: dict[str, list[RequestRecord]] = {k: [] for k in fleets}
        tallies = {k: _Tally() for k in fleets}
        for key, fleet in fleets.items():
            model = fleet.config.model_name
            closed_loop(clients_of[key], model, prompts, clients=clients, max_requests=4 * clients)  # warm
        for r in range(rounds):
            for key, fleet in fleets.items():
                client, model = clients_of[key], fleet.config.model_name
                part = lone_requests // rounds
                lone[key] += closed_loop(client, model, prompts[r * part :], clients=1, max_requests=part).records
                pids = {"producer": os.getpid(), "redis": redis_pid, "worker": fleet.pid}
                run = _loop_runner(client, model, prompts, per_message[key], clients, duration_s / rounds)
                _metered(tallies[key], pids, redis_url, run)
            for floor in floor_runs.values():
                floor.lone(lone_requests // rounds)  # like the variants' lone requests: spread over the rounds
                floor.measure_round(duration_s / rounds)
        results = _variant_results(variants, per_message, lone, tallies, clients, log)
        main_key = next(iter(fleets))
        main_cfg = fleets[main_key].config
        out: dict[str, Any] = {
            "model": main_cfg.model_name, "max_batch_size": main_cfg.max_batch_size,
            "concurrency": main_cfg.concurrency, "celery_loglevel": main_cfg.celery_loglevel, "rounds": rounds,
            "lone": results[main_key]["lone"], "loop": results[main_key]["loop"],
            "ablations": {k: v for k, v in results.items() if k != main_key},
        }  # fmt: skip
        if profile_s > 0:
            out["profile"] = _profile(clients_of[main_key], fleets[main_key], main_cfg.model_name, prompts,
                                      clients=clients, duration_s=profile_s)  # fmt: skip
        if floor_runs:
            out["floor"] = {k: run.result() for k, run in floor_runs.items()}
    finally:
        for fleet in fleets.values():
            fleet.stop()
        for floor in floor_runs.values():
            floor.stop()
    return out
