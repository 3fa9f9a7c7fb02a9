"""The one-Redis ceiling per path, the lone-request breakdown and the before/after table (pure).

Every worker and producer of a fleet shares one Redis, and a Redis server executes commands on one
core: at ``r`` Redis CPU-ms per request it serves at most ``1000 / r`` requests/s, however many
workers are added. :func:`path_summary` condenses one dispatch run into per-path figures;
the ``*_table`` functions render them as Markdown.
"""

from __future__ import annotations

import math
from typing import Any

from bench.markdown import fmt, md_table

__all__ = ["ceiling_rps", "ceiling_section", "celery_floor_note", "floor_note", "path_summary", "repeat_table",
           "targets_table"]

PATH_LABELS = {
    "served": "`fleet.infer` (FleetClient.submit + result)",
    "legacy": "`fleet.infer` as before issue 11 (old producer and worker round trips, extended results)",
    "no-events": "`fleet.infer`, no task events",
    "started": "`fleet.infer`, STARTED stored for every request",
    "lean": "`fleet.infer`, lean Celery (no events, STARTED state, extended result)",
    "bulk": "`fleet.infer_bulk` (FleetClient.submit_bulk + wait)",
    "gateway": "gateway (POST /v1/requests + polled GET)",
    "floor-events": "stock Celery, empty task, task + sent events (no fleet code: `bench/celery_floor.py`)",
    "floor-lean": "stock Celery, empty task, no events",
}
"""Paths of the summary, in table order (keys of the dispatch results)."""

LONE_STEPS = {
    "producer": "producer: build, admission, idempotency marker, publish",
    "broker_and_task_start": "broker wake-up (BRPOP) + Celery task start",
    "batch_window": "batch window (scheduler)",
    "engine": "engine (`session.run`)",
    "result_and_wakeup": "result store + publish, client wake-up",
    "total": "**round trip**",
    "over_bare_ms": "**over one bare `session.run`**",
}


def ceiling_rps(redis_cpu_ms: float) -> float:
    """Requests/s at 100 % of one Redis core for ``redis_cpu_ms`` per request (NaN when unknown or 0)."""
    return 1000.0 / redis_cpu_ms if redis_cpu_ms > 0 else float("nan")


def _row(loop: dict[str, Any]) -> dict[str, Any]:
    cpu = loop["cpu_ms_per_request"]
    redis_ms = float(cpu.get("redis", 0.0))
    front = float(cpu.get("producer", cpu.get("gateway", 0.0)))
    return {
        "qps": loop["summary"]["qps"],
        "redis_calls": loop["redis_calls_total_per_request"],
        "redis_calls_by_command": loop["redis_calls_per_request"],
        "redis_cpu_ms": round(redis_ms, 3),
        "front_cpu_ms": round(front, 3),
        "worker_cpu_ms": round(float(cpu.get("worker", 0.0)), 3),
        "total_cpu_ms": round(sum(float(v) for v in cpu.values()), 3),
        "ceiling_rps": round(ceiling_rps(redis_ms), 0),
    }


def path_summary(dispatch: dict[str, Any]) -> dict[str, Any]:
    """Per-path figures of one dispatch run (see ``PATH_LABELS``), its lone request and its commit."""
    paths: dict[str, Any] = {"served": _row(dispatch["loop"])}
    for key, abl in (dispatch.get("ablations") or {}).items():
        if key in PATH_LABELS:
            paths[key] = _row(abl["loop"])
    if "gateway" in dispatch:
        paths["gateway"] = _row(dispatch["gateway"])
    for key, floor in (dispatch.get("floor") or {}).items():
        paths[f"floor-{key}"] = _row(floor)
    meta = dispatch.get("meta", {})
    lone = dispatch.get("lone_profile", {})
    return {
        "commit": meta.get("commit"),
        "dirty": meta.get("dirty"),
        "paths": paths,
        "lone_p50_ms": dispatch["lone"]["latency"]["p50_ms"],
        "lone_over_bare_ms": (lone.get("pubsub") or {}).get("over_bare_ms"),
        "floor_lone_p50_ms": {k: f.get("lone_p50_ms") for k, f in (dispatch.get("floor") or {}).items()},
    }


def _paths_table(summary: dict[str, Any]) -> str:
    rows = [
        [
            PATH_LABELS[k],
            fmt(p["qps"], 0),
            fmt(p["redis_calls"], 1),
            fmt(p["redis_cpu_ms"], 3),
            fmt(p["front_cpu_ms"], 2),
            fmt(p["worker_cpu_ms"], 2),
            fmt(p["total_cpu_ms"], 2),
            f"**{fmt(p['ceiling_rps'], 0)}**",
        ]
        for k, p in summary["paths"].items()
    ]
    head = [
        "path",
        "req/s, one worker",
        "Redis commands/request",
        "Redis CPU-ms/request",
        "producer or gateway CPU-ms",
        "worker CPU-ms",
        "total CPU-ms/request",
        "one-Redis ceiling, req/s",
    ]
    return md_table(head, rows)


def _lone_table(lone: dict[str, Any]) -> str:
    rows = [[label, fmt(lone["pubsub"].get(k), 2), fmt(lone["poll"].get(k), 2)] for k, label in LONE_STEPS.items()]
    return md_table(["step (median ms)", "waiting on pub/sub (`result(wait=True)`)", "polling MGET (`wait`)"], rows)


def _ratio(new: float, old: float) -> str:
    return "–" if not old or math.isnan(old) or math.isnan(new) else f"{new / old:.2f}×"


def _before_after_table(runs: dict[str, Any]) -> str:
    rows = []
    labels = list(runs)
    first = runs[labels[0]]
    for label in labels:
        run = runs[label]
        for key, p in run["paths"].items():
            base = first["paths"].get(key)
            rows.append(
                [
                    f"{label} ({(run.get('commit') or '?')[:7]}{'+' if run.get('dirty') else ''})",
                    PATH_LABELS[key],
                    fmt(p["qps"], 0),
                    fmt(p["redis_calls"], 1),
                    fmt(p["redis_cpu_ms"], 3),
                    fmt(p["total_cpu_ms"], 2),
                    fmt(p["ceiling_rps"], 0),
                    _ratio(p["qps"], base["qps"]) if base else "–",
                    _ratio(p["redis_calls"], base["redis_calls"]) if base else "–",
                    _ratio(p["total_cpu_ms"], base["total_cpu_ms"]) if base else "–",
                ]
            )
        rows.append(
            [
                f"{label}: lone request p50 / over bare",
                "",
                fmt(run.get("lone_p50_ms"), 2) + " ms",
                "",
                "",
                "",
                "",
                "",
                "",
                fmt(run.get("lone_over_bare_ms"), 2) + " ms",
            ]
        )
    head = [
        "run",
        "path",
        "req/s",
        "Redis cmds/req",
        "Redis CPU-ms/req",
        "total CPU-ms/req",
        "ceiling req/s",
        f"req/s vs {labels[0]}",
        f"cmds vs {labels[0]}",
        f"CPU vs {labels[0]}",
    ]
    return md_table(head, rows)


FLOOR_GROUPS = {
    "kombu's delivery with per-request acks (`lpush`, `brpop` and, with the queue backed up, `rpop` of several "
    "more, `zadd`/`hset` on take, `zrem`/`hdel` on ack, inside the store script for a success; `multi`/`exec` "
    "around each pair on the old path)": ("lpush", "brpop", "rpop", "zadd", "hset", "zrem", "hdel"),
    "Celery's result store and wait (one `evalsha` running `set` + `publish`; `get` + `setex` on the old path; "
    "the waiter's `subscribe`/`get`/`unsubscribe`)": ("evalsha", "get", "setex", "publish", "subscribe",
                                                       "unsubscribe"),
    "the fleet's own (`set` marker, `exists` cancel mark, `incrby`/`expire` drain meter, admission's `llen`)": (
        "exists", "incrby", "expire", "llen"),
}  # fmt: skip
"""Who issues which command of a request with every Celery extra off (from reading kombu, Celery and the fleet).
``set`` is split by hand: one per request is the producer's 'queued' marker, the rest the result store's."""


def floor_note(lean: dict[str, Any]) -> str:
    """What one request still costs with every Celery extra off, split by who issues it (Markdown)."""
    calls = lean["redis_calls_by_command"]
    pairs = calls.get("multi", 0.0)
    kombu_pairs = min(pairs, 2.0 * calls.get("zadd", 0.0))  # one transaction on take, one on ack
    marker = min(1.0, calls.get("set", 0.0))  # the producer's SET NX; the result store's SETs are the rest
    parts = []
    for label, names in FLOOR_GROUPS.items():
        n = sum(calls.get(k, 0.0) for k in names)
        if names[0] == "lpush":
            n += 2 * kombu_pairs
        elif names[0] == "evalsha":
            n += 2 * max(0.0, pairs - kombu_pairs) + calls.get("set", 0.0) - marker
        else:
            n += marker
        parts.append(f"{label}: {fmt(n, 1)}")
    return (
        f"**What Celery itself costs.** With every extra off (lean), a request still takes "
        f"{fmt(lean['redis_calls'], 1)} Redis commands and {fmt(lean['redis_cpu_ms'], 3)} Redis CPU-ms (one-Redis "
        f"ceiling {fmt(lean['ceiling_rps'], 0)} req/s), and {fmt(lean['total_cpu_ms'], 2)} CPU-ms in all: "
        + "; ".join(parts)
        + ". The first two are what at-least-once delivery with per-request acks and per-request results cost "
        "through Celery and kombu; below them only the bulk path goes (one message, one take and one ack per chunk)."
    )


def celery_floor_note(runs: dict[str, Any]) -> str:
    """What stock Celery's empty task (same run) says about issue 11's targets (Markdown; "" without it)."""
    last = runs[list(runs)[-1]] if runs else {}
    paths = last.get("paths", {})
    events, lean, served, old = paths.get("floor-events"), paths.get("floor-lean"), paths.get("served"), None
    old = paths.get("legacy")
    if not (events and served and old):
        return ""
    need = 2 * old["qps"]
    stops = events["qps"] < need
    lone = (last.get("floor_lone_p50_ms") or {}).get("events")
    text = (
        f"**Stock Celery's own floor.** An empty task through stock Celery with the same guarantees "
        f"(`acks_late`, a result stored by ID and waited for by pub/sub, task and sent events so that Flower sees "
        f"every request; `bench/celery_floor.py`, no fleet code) ran {fmt(events['qps'], 0)} req/s in the same run, "
        f"at {fmt(events['redis_calls'], 1)} Redis commands and {fmt(events['total_cpu_ms'], 2)} CPU-ms per request"
        + (f", lone round trip {fmt(lone, 2)} ms at p50" if lone else "")
        + f". `fleet.infer` as served ran {fmt(served['qps'], 0)} req/s ({_ratio(served['qps'], events['qps'])} "
        f"stock Celery's empty task) at {fmt(served['redis_calls'], 1)} commands "
        f"({_ratio(served['redis_calls'], events['redis_calls'])}) and {fmt(served['total_cpu_ms'], 2)} CPU-ms "
        f"({_ratio(served['total_cpu_ms'], events['total_cpu_ms'])}), validation, batching and an ONNX Runtime "
        f"call included. "
    )
    if stops:
        text += (
            f"The 2× target ({fmt(need, 0)} req/s) is {_ratio(need, events['qps'])} what stock Celery does with no "
            "work at all on this machine: with one Celery task per request and Flower seeing each, Celery itself "
            "(its worker's consumer, tracer and event dispatcher, and the producer side of the same protocol) is "
            "what stops it."
        )
    else:
        text += f"Stock Celery's empty task clears the 2× target ({fmt(need, 0)} req/s): Celery alone does not stop it."
    if lean:
        text += (
            f" Without events (Flower then sees no request) stock Celery's empty task runs {fmt(lean['qps'], 0)} "
            f"req/s ({_ratio(lean['qps'], old['qps'])} the old path)."
        )
    return text


def repeat_table(runs: dict[str, Any]) -> str:
    """Each run that measured the old path beside the new one (and stock Celery's floor): the target ratios
    run by run, so the machine's run-to-run spread is in view (Markdown; "" with fewer than two)."""
    rows = []
    for label, run in runs.items():
        p = run["paths"]
        old, new, floor = p.get("legacy"), p.get("served"), p.get("floor-events")
        if not (old and new):
            continue
        lone = (run.get("floor_lone_p50_ms") or {}).get("events")
        rows.append([
            label, f"{fmt(new['qps'], 0)} / {fmt(old['qps'], 0)}", _ratio(new["qps"], old["qps"]),
            _ratio(new["redis_calls"], old["redis_calls"]), _ratio(new["total_cpu_ms"], old["total_cpu_ms"]),
            fmt(run.get("lone_over_bare_ms"), 2),
            _ratio(floor["qps"], old["qps"]) if floor else "–",
            _ratio(floor["total_cpu_ms"], old["total_cpu_ms"]) if floor else "–",
            _ratio(new["qps"], floor["qps"]) if floor else "–", fmt(lone, 2) if lone else "–",
        ])  # fmt: skip
    if len(rows) < 2:
        return ""
    head = ["run", "req/s new / old", "req/s", "commands", "CPU-ms", "lone ms over bare",
            "stock Celery req/s vs old", "stock Celery CPU-ms vs old", "new req/s vs stock Celery",
            "stock Celery lone round trip ms"]  # fmt: skip
    return md_table(head, rows)


def _verdict(ok: bool) -> str:
    return "met" if ok else "**not met**"


def targets_table(runs: dict[str, Any]) -> str:
    """Issue 11's targets for ``fleet.infer``: as served against the old path run beside it in the same run
    (``legacy``; else the first run), with the lean and bulk variants to show what reaching them takes."""
    if not runs:
        return ""
    last = runs[list(runs)[-1]]
    if "legacy" in last["paths"]:
        base, what = last, "the old path, same run"
    elif len(runs) > 1:
        base, what = runs[next(iter(runs))], f"run {next(iter(runs))}"
    else:
        return ""
    b = base["paths"].get("legacy", base["paths"]["served"])
    a = last["paths"]["served"]
    rows = [
        ["Redis commands per request ≤ 0.5×", f"{fmt(b['redis_calls'], 1)} → {fmt(a['redis_calls'], 1)}",
         _ratio(a["redis_calls"], b["redis_calls"]), _verdict(a["redis_calls"] <= 0.5 * b["redis_calls"])],
        ["CPU-ms per request ≤ 0.5×", f"{fmt(b['total_cpu_ms'], 2)} → {fmt(a['total_cpu_ms'], 2)}",
         _ratio(a["total_cpu_ms"], b["total_cpu_ms"]), _verdict(a["total_cpu_ms"] <= 0.5 * b["total_cpu_ms"])],
        ["requests/s of one worker ≥ 2×", f"{fmt(b['qps'], 0)} → {fmt(a['qps'], 0)}",
         _ratio(a["qps"], b["qps"]), _verdict(a["qps"] >= 2 * b["qps"])],
    ]  # fmt: skip
    over = last.get("lone_over_bare_ms")
    if over is not None:
        rows.append(["lone request within 5 ms of a bare run", f"{fmt(over, 2)} ms over", "", _verdict(over <= 5.0)])
    for key in ("lean", "bulk", "floor-events", "floor-lean"):
        p = last["paths"].get(key)
        if p:
            rows.append([
                f"for scale: {PATH_LABELS[key]}",
                f"{fmt(p['redis_calls'], 1)} commands, {fmt(p['total_cpu_ms'], 2)} CPU-ms, {fmt(p['qps'], 0)} req/s",
                f"{_ratio(p['redis_calls'], b['redis_calls'])} commands, {_ratio(p['qps'], b['qps'])} req/s",
                "",
            ])  # fmt: skip
    return md_table([f"target (`fleet.infer` as served vs {what})", "before → after", "ratio", "verdict"], rows)


def ceiling_section(results: dict[str, Any]) -> str:
    """The ``### Per path`` part of Dispatch cost: paths table, gateway commands, lone profile, runs."""
    d = results.get("dispatch") or {}
    if "loop" not in d:
        return ""
    summary = path_summary(d)
    out = [
        "### Per path: Redis commands, CPU and the one-Redis ceiling\n",
        "Per request, each path on its own worker of the identity model (closed loop). CPU-ms are user + system "
        "time of each process (the gateway path's HTTP callers are not counted). Redis runs commands on one core, "
        "so **the one-Redis ceiling is 1000 / Redis CPU-ms per request**: the most requests/s the whole fleet "
        "can carry on that path through one Redis, however many workers are added.\n",
        _paths_table(summary) + "\n",
    ]
    meta = d.get("meta")
    if meta:
        dirty = " (uncommitted changes)" if meta.get("dirty") else ""
        out.insert(
            2,
            f"Measured by `{meta.get('command')}` at commit {meta.get('commit')}{dirty} in "
            f"{fmt(meta.get('duration_s'), 0)} s, load average {meta.get('load_average_start')} → "
            f"{meta.get('load_average_end')} on a shared machine: compare rows of one run, not runs.\n",
        )
    gw = d.get("gateway")
    if gw:
        out.append(
            f"Gateway: callers poll `GET /v1/requests/{{id}}` from 2 ms, backing off ×1.5 to 20 ms "
            f"({gw['polls_per_request']} GETs per request); Redis commands per request: "
            + ", ".join(f"`{k}` {v}" for k, v in gw["redis_calls_per_request"].items())
            + "\n"
        )
    lone = d.get("lone_profile")
    if lone:
        out += [
            f"**Where a lone request's time goes** ({lone['requests']} requests one at a time, identity model; "
            f"one bare `session.run` of it: {fmt(lone['bare_session_run_ms'], 3)} ms). Steps from the worker's "
            "own timings: `queue_wait_ms` (submit → batch start) minus the batch window minus the producer's "
            "part is the broker and task start; the round trip minus `queue_wait_ms` and the engine is the "
            "result's way back.\n",
            _lone_table(lone) + "\n",
        ]
    runs = results.get("dispatch_runs") or {}
    if runs:
        out += [
            "### Before and after (one `fleet bench --only dispatch` run each)\n",
            _before_after_table(runs) + "\n",
        ]
        targets = targets_table(runs)
        if targets:
            out += ["**Issue 11's targets** (measured, not asserted in tests):\n", targets + "\n"]
        lean = runs[list(runs)[-1]]["paths"].get("lean")
        if lean:
            out.append(floor_note(lean) + "\n")
        stock = celery_floor_note(runs)
        if stock:
            out.append(stock + "\n")
        repeats = repeat_table(runs)
        if repeats:
            out += [
                "**Run to run** (the same command repeated on this shared machine; ratios against the old path "
                "of the same run; stock Celery = its empty task with task and sent events):\n",
                repeats + "\n",
            ]
    return "\n".join(out)
