"""The generation rows: one-at-a-time, static and continuous batching on real workers, and the limit.

Every fleet row is a real worker (``celery worker`` subprocess, its own queue, the same private
Redis) serving the same LM; requests are ``fleet.infer`` tasks with ``output.kind = generate``
(greedy, ``ignore_eos``, so every request makes exactly its ``max_new_tokens``). The workload mixes
prompt and output lengths; the same requests go to every row:

* **saturation** — the whole workload submitted at once;
* **offered load** — Poisson arrivals at fractions of the continuous row's saturation request rate.

The worker's Prometheus endpoint gives each run's step time and KV re-layout (copy) time. The
limit runs the worker's own generation code in this process (:mod:`bench.genlimit`): a bare decode
loop per batch size and the generation loop over the same workload, before and after the fleet
rows (the better pass is kept), then the price of one KV re-layout and ORT's profile of a decode step.
"""

from __future__ import annotations

import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.genlimit import Work, concat_share, decode_limit, load_engine, loop_run, relayout_cost
from bench.genstats import GenRecord, arrival_offsets, metric_delta, parse_metrics, summarize_generation
from bench.load import scheduled
from bench.plan import GenPlan
from bench.procs import FleetConfig, RunningFleet, flush_redis
from producer.client import FleetClient
from protocol.errors import FleetError
from protocol.messages import InferenceResult
from protocol.modelcard import load_card
from tools.calibration import synthetic_sequences
from tools.redis_server import free_port
from workers.engine import Engine

__all__ = ["ROWS", "gen_workload", "measure_generation"]

Say = Callable[[str], None]

ROWS: dict[str, str] = {
    "one_at_a_time": "one at a time (max_batch_size 1, C = 1)",
    "static": "static batching (max_batch_size {b}, C = {c})",
    "continuous": "continuous batching (max_batch_size {b}, C = {c})",
}
"""Row key → label (``{b}``, ``{c}``: the plan's max_batch_size and concurrency)."""

_METRICS = (
    "fleet_worker_generation_step_seconds_sum",
    "fleet_worker_generation_step_seconds_count",
    "fleet_worker_kv_copy_seconds_sum",
    "fleet_worker_kv_copy_seconds_count",
    "fleet_worker_generated_tokens_total",
)


def gen_workload(gp: GenPlan, vocab_size: int, count: int, seed: int) -> Work:
    """``count`` seeded (prompt, max_new_tokens) pairs, both lengths uniform in the plan's ranges."""
    lo, hi = gp.prompt_tokens
    prompts = synthetic_sequences(count, vocab_size=vocab_size, min_tokens=lo, max_tokens=hi, seed=seed)
    outputs = np.random.default_rng(seed + 1).integers(gp.output_tokens[0], gp.output_tokens[1] + 1, size=count)
    return [(p, int(n)) for p, n in zip(prompts, outputs, strict=True)]


def _configs(gp: GenPlan, model: str, path: Path, max_wait_ms: float,
             providers: tuple[str, ...] = ("CPUExecutionProvider",)) -> dict[str, FleetConfig]:  # fmt: skip
    common: dict[str, Any] = {
        "model_path": path, "max_wait_ms": max_wait_ms, "max_input_tokens": gp.prompt_tokens[1],
        "max_new_tokens": gp.output_tokens[1], "celery_loglevel": "WARNING", "providers": providers,
        "engine_extra": {"require_provider": providers[0]} if providers != ("CPUExecutionProvider",) else {},
    }  # fmt: skip
    sizes = {"one_at_a_time": (1, 1, True), "static": (gp.max_batch_size, gp.concurrency, False),
             "continuous": (gp.max_batch_size, gp.concurrency, True)}  # fmt: skip
    return {
        key: FleetConfig(label=f"gen-{key}", model_name=f"{model}-gen-{key.replace('_', '-')}", max_batch_size=b,
                         concurrency=c, continuous=cont, metrics_port=free_port(), **common)
        for key, (b, c, cont) in sizes.items()
    }  # fmt: skip


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return parse_metrics(resp.read().decode(), _METRICS)


Run = tuple[list[GenRecord], dict[str, float]]
"""One run's records and the worker's metric deltas over it."""


def _run(fleet: RunningFleet, client: FleetClient, work: Work, offsets: list[float]) -> Run:
    """Submit ``work[n]`` at ``offsets[n]``; the records and the worker's metric deltas."""
    model = fleet.config.model_name

    def submit(n: int) -> str:
        prompt, new = work[n % len(work)]
        return client.submit(model, prompt, generation={"max_new_tokens": new, "temperature": 0, "ignore_eos": True})

    def record(n: int, submitted: float, done: float, out: InferenceResult | FleetError) -> GenRecord:
        if isinstance(out, InferenceResult):
            return GenRecord.from_result(submitted, done, out)
        return GenRecord(submitted, done, len(work[n % len(work)][0]), error=f"{type(out).__name__}: {out}")

    before = _scrape(fleet.config.metrics_port)
    records = scheduled(client, offsets, submit, record)
    return records, metric_delta(before, _scrape(fleet.config.metrics_port))


def _summary(runs: list[Run]) -> dict[str, Any]:
    """Pooled summary of ``runs`` plus the worker's step and copy time over them."""
    summary = summarize_generation([records for records, _ in runs]).as_dict()
    d = {name: sum(delta.get(name, 0.0) for _, delta in runs) for name in _METRICS}
    step_s, copy_s = d["fleet_worker_generation_step_seconds_sum"], d["fleet_worker_kv_copy_seconds_sum"]
    summary["worker"] = {
        "steps": d["fleet_worker_generation_step_seconds_count"],
        "step_s": step_s,
        "copy_s": copy_s,
        "relayouts": d["fleet_worker_kv_copy_seconds_count"],
        "copy_share": copy_s / step_s if step_s > 0 else float("nan"),
        "busy_share": step_s / summary["span_s"] if summary["span_s"] > 0 else float("nan"),
        "tokens": d["fleet_worker_generated_tokens_total"],
    }
    return summary


def _fleet_rows(gp: GenPlan, configs: dict[str, FleetConfig], redis_url: str, work_dir: Path, work: Work,
                open_work: Work, seed: int, say: Say) -> dict[str, Any]:  # fmt: skip
    """Serve every row at once; saturation rounds (order reversed every other round, pooled), then the
    offered loads, rows visited in turn."""
    fleets = {key: RunningFleet(cfg, redis_url, work_dir) for key, cfg in configs.items()}
    for fleet in fleets.values():
        fleet.spawn()
    rows: dict[str, Any] = {}
    try:
        clients = {key: fleet.ready() for key, fleet in fleets.items()}
        for key, fleet in fleets.items():  # warm: first steps at each shape class, not counted
            _run(fleet, clients[key], work[: gp.warm_requests], [0.0] * gp.warm_requests)
            rows[key] = {"status": "ok", "label": ROWS[key].format(b=gp.max_batch_size, c=gp.concurrency),
                         "max_batch_size": fleet.config.max_batch_size, "concurrency": fleet.config.concurrency,
                         "continuous": fleet.config.continuous, "start_s": round(fleet.start_s, 1)}  # fmt: skip
        sat: dict[str, list[Run]] = {key: [] for key in fleets}
        for r in range(gp.rounds):
            for key in list(fleets)[:: 1 if r % 2 == 0 else -1]:
                sat[key].append(_run(fleets[key], clients[key], work, arrival_offsets(None, len(work), seed)))
        for key, runs in sat.items():
            rows[key]["saturation"] = s = _summary(runs)
            rows[key]["saturation_rounds"] = [summarize_generation([recs]).tokens_per_s for recs, _ in runs]
            say(f"generation {key}: {s['tokens_per_s']:.0f} tokens/s at saturation ({s['requests']} requests, "
                f"TTFT p99 {s['ttft']['p99_ms']:.0f} ms, mean batch {s['mean_batch']:.1f})")  # fmt: skip
        base_rps = float(rows["continuous"]["saturation"]["requests_per_s"])
        mean_new = float(np.mean([n for _, n in open_work]))
        for key in fleets:
            rows[key]["open"] = []
        for i, frac in enumerate(gp.open_fractions):
            rate = max(0.1, frac * base_rps)
            count = int(min(gp.open_max_requests, max(gp.open_min_requests, round(rate * gp.open_duration_s))))
            offsets = arrival_offsets(rate, count, seed + 10 + i)
            for key, fleet in fleets.items():
                s = _summary([_run(fleet, clients[key], open_work[:count], offsets)])
                rows[key]["open"].append({"fraction": frac, "offered_rps": rate, "requests": count,
                                          "offered_tokens_per_s": rate * mean_new, "summary": s})  # fmt: skip
            say(f"generation load {rate:.2f} req/s: " + ", ".join(
                f"{k} {rows[k]['open'][-1]['summary']['tokens_per_s']:.0f} tok/s" for k in fleets))  # fmt: skip
    finally:
        for fleet in fleets.values():
            fleet.stop()
    return rows


def _in_process_pass(gp: GenPlan, engine: Engine, work: Work, steps: int) -> dict[str, Any]:
    """One pass of the limit sweep and of the generation loop (continuous, static) over ``work``."""
    prompts = [p for p, _ in work]
    decode_limit(engine, prompts, 1, 2)  # first run: allocations
    return {
        "points": [decode_limit(engine, prompts, b, steps) for b in gp.limit_batch_sizes],
        "loop": {
            name: loop_run(engine, work, max_batch_size=gp.max_batch_size, continuous=cont)
            for name, cont in (("continuous", True), ("static", False))
        },
    }


def _best(entries: list[dict[str, Any]]) -> dict[str, Any]:
    return max(entries, key=lambda e: float(e["tokens_per_s"]))


def _merge(passes: list[dict[str, Any]], say: Say) -> dict[str, Any]:
    """The best of the passes per batch size and per loop (background load only ever lowers a ceiling)."""
    points = [_best([p["points"][i] for p in passes]) for i in range(len(passes[0]["points"]))]
    loop = {name: _best([p["loop"][name] for p in passes]) for name in passes[0]["loop"]}
    best = _best(points)
    loops = ", ".join(f"{n} {r['tokens_per_s']:.0f} tokens/s (copy share {r['shares']['copy_share']:.0%})"
                      for n, r in loop.items())  # fmt: skip
    say(f"generation limit: best {best['tokens_per_s']:.0f} tokens/s at batch {best['batch_size']} "
        f"(batch 1: {points[0]['tokens_per_s']:.0f}); in process: {loops}")  # fmt: skip
    return {
        "points": points, "best": best, "loop": loop,
        "passes": [{"points": [round(float(x["tokens_per_s"]), 1) for x in p["points"]],
                    "loop": {n: round(float(r["tokens_per_s"]), 1) for n, r in p["loop"].items()}} for p in passes],
    }  # fmt: skip


def measure_generation(gp: GenPlan, model_path: Path, redis_url: str, work_dir: Path, *, max_wait_ms: float,
                       seed: int, say: Say | None = None,
                       providers: tuple[str, ...] = ("CPUExecutionProvider",)) -> dict[str, Any]:  # fmt: skip
    """Every generation figure of the report (see the module docstring) as one JSON-friendly dict; the
    in-process limit, the profile and the fleet rows all run on ``providers`` (``fleet bench --provider``)."""
    log = say or (lambda msg: print(msg, file=sys.stderr))
    started = time.monotonic()
    card = load_card(model_path)
    work = gen_workload(gp, card.vocab_size, gp.requests, seed + 300)
    open_work = gen_workload(gp, card.vocab_size, gp.open_max_requests, seed + 400)
    engine = load_engine(model_path, card, max(gp.limit_batch_sizes), providers)
    steps = gp.limit_steps or round(float(np.mean([n for _, n in work])))
    passes = [_in_process_pass(gp, engine, work, steps)]
    flush_redis(redis_url)
    configs = _configs(gp, card.name, model_path, max_wait_ms, providers)
    rows = _fleet_rows(gp, configs, redis_url, work_dir, work, open_work, seed, log)
    passes.append(_in_process_pass(gp, engine, work, steps))
    limit = _merge(passes, log)
    past = round(float(np.mean([len(p) for p, _ in work])) + steps / 2)
    limit["relayout"] = relayout_cost(engine, [p for p, _ in work], gp.max_batch_size, steps)
    limit["profile"] = concat_share(model_path, card, batch_size=gp.max_batch_size, past=past, runs=gp.profile_runs,
                                    providers=providers)
    return {
        "model": card.name,
        "plan": gp.__dict__,
        "workload": {
            "requests": len(work),
            "prompt_tokens_mean": float(np.mean([len(p) for p, _ in work])),
            "output_tokens_mean": float(np.mean([n for _, n in work])),
            "output_tokens_total": int(sum(n for _, n in work)),
        },
        "rows": rows,
        "limit": limit,
        "providers": {"requested": list(providers), "active": list(engine.providers)},
        "kv_in_place": engine.kv.in_place,
        "duration_s": round(time.monotonic() - started, 1),
    }
