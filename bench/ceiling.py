"""The one-Redis ceiling per path, the lone-request breakdown and what Celery itself costs (pure).

Every worker and producer of a fleet shares one Redis, and a Redis server executes commands on one
core: at ``r`` Redis CPU-ms per request it serves at most ``1000 / r`` requests/s, however many
workers are added. :func:`path_summary` condenses one run's dispatch figures into per-path figures;
:func:`ceiling_section` renders them as Markdown. Everything comes from that one run.
"""

from __future__ import annotations

import math
from typing import Any

from bench.markdown import fmt, md_table

__all__ = ["ceiling_rps", "ceiling_section", "celery_floor_note", "floor_note", "path_summary"]

PATH_LABELS = {
    "served": "`fleet.infer` (FleetClient.submit + result)",
    "no-events": "`fleet.infer`, no task events",
    "started": "`fleet.infer`, STARTED stored for every request",
    "lean": "`fleet.infer`, lean Celery (no events, STARTED state, extended result)",
    "bulk": "`fleet.infer_bulk` (FleetClient.submit_bulk + wait)",
    "gateway": "gateway (POST /v1/requests + polled GET)",
    "gateway-wait": "gateway (POST /v1/requests + one long-poll GET `?wait_s=`)",
    "floor-events": "stock Celery, empty task, task + sent events (no fleet code: `bench/celery_floor.py`)",
    "floor-lean": "stock Celery, empty task, no events",
}
"""Paths of the summary, in table order (keys of the dispatch results)."""

LONE_STEPS = {
    "producer": "producer: build, admission, one script claiming the ID and queueing the task",
    "broker_and_task_start": "broker wake-up (`BLMOVE`), the take script + Celery task start",
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
    if "gateway_wait" in dispatch:
        paths["gateway-wait"] = _row(dispatch["gateway_wait"])
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


FLOOR_GROUPS = {
    "kombu's delivery with per-request acks (`lpush` inside the producer's script; the worker's `blmove` wait and "
    "its take script's `lrange`/`ltrim` once per batch, its `zadd`/`hset` per message; `zrem`/`hdel` on ack, "
    "inside the result store's script for a success; `brpop`/`rpop` where Redis refuses the take script)": (
        "lpush", "blmove", "lrange", "ltrim", "zadd", "hset", "zrem", "hdel", "brpop", "rpop", "multi", "exec"),
    "Celery's result store and wait (the store script's `set` + `publish`; the waiter's `subscribe`/`get`/"
    "`unsubscribe`)": ("get", "setex", "publish", "subscribe", "unsubscribe"),
    "the fleet's own (the producer's `set` NX marker and its `exists` look-up of a stored result, both inside "
    "its script, the take script's `exists` cancel mark, the drain meter's `incrby`/`expire`, admission's "
    "`llen`)": ("exists", "incrby", "expire", "llen"),
    "the three scripts that make those steps atomic (`evalsha`: the producer's claim-and-queue per submit, the "
    "worker's take per batch, the result store per stored state)": ("evalsha",),
}  # fmt: skip
"""Who issues which command of a request with every Celery extra off (from reading kombu, Celery and the fleet:
``producer/idempotent_queue.py``, ``broker/atomic_take.py``, ``broker/result_backend.py``). Redis counts the
commands a script runs as commands of their own, so a script is its ``evalsha`` plus what it runs. ``set`` is
split by hand: one per request is the producer's marker (``SET NX`` in its script), the rest the result store's."""


def floor_note(lean: dict[str, Any]) -> str:
    """What one request still costs with every Celery extra off, split by who issues it (Markdown).

    Commands no group names (none, as the fleet is written) are shown as "other", so the parts always add
    up to the measured total."""
    calls = lean["redis_calls_by_command"]
    marker = min(1.0, calls.get("set", 0.0))  # the producer's SET NX; the result store's SETs are the rest
    parts = []
    named = 0.0
    for label, names in FLOOR_GROUPS.items():
        n = sum(calls.get(k, 0.0) for k in names)
        named += n
        if names[0] == "get":
            n += calls.get("set", 0.0) - marker
        elif names[0] == "exists":
            n += marker
        parts.append(f"{label}: {fmt(n, 1)}")
    other = sum(calls.values()) - named - calls.get("set", 0.0)
    if other >= 0.05:
        parts.append(f"other: {fmt(other, 1)}")
    return (
        f"**What Celery itself costs.** With every extra off (lean), a request still takes "
        f"{fmt(lean['redis_calls'], 1)} Redis commands and {fmt(lean['redis_cpu_ms'], 3)} Redis CPU-ms (one-Redis "
        f"ceiling {fmt(lean['ceiling_rps'], 0)} req/s), and {fmt(lean['total_cpu_ms'], 2)} CPU-ms in all: "
        + "; ".join(parts)
        + ". The first two are what at-least-once delivery with per-request acks and per-request results cost "
        "through Celery and kombu; below them only the bulk path goes (one message, one take and one ack per chunk)."
    )


def celery_floor_note(summary: dict[str, Any]) -> str:
    """How ``fleet.infer`` compares with stock Celery's empty task measured in the same run (Markdown; "" when
    the run did not measure stock Celery)."""
    paths = summary.get("paths", {})
    events, lean, served = paths.get("floor-events"), paths.get("floor-lean"), paths.get("served")
    if not (events and served):
        return ""
    lone = (summary.get("floor_lone_p50_ms") or {}).get("events")
    text = (
        f"**Stock Celery's own floor.** An empty task through stock Celery with the same guarantees "
        f"(`acks_late`, a result stored by ID and waited for by pub/sub, task and sent events so that Flower sees "
        f"every request; `bench/celery_floor.py`, no fleet code) ran {fmt(events['qps'], 0)} req/s, "
        f"at {fmt(events['redis_calls'], 1)} Redis commands and {fmt(events['total_cpu_ms'], 2)} CPU-ms per request"
        + (f", lone round trip {fmt(lone, 2)} ms at p50" if lone else "")
        + f". `fleet.infer` as served ran {fmt(served['qps'], 0)} req/s ({_ratio(served['qps'], events['qps'])} "
        f"stock Celery's empty task) at {fmt(served['redis_calls'], 1)} commands "
        f"({_ratio(served['redis_calls'], events['redis_calls'])}) and {fmt(served['total_cpu_ms'], 2)} CPU-ms "
        f"({_ratio(served['total_cpu_ms'], events['total_cpu_ms'])}), with validation, batching and an ONNX "
        "Runtime call included"
    )
    if served["qps"] >= events["qps"] and served["total_cpu_ms"] <= events["total_cpu_ms"]:
        text += ": the fleet's one task per request costs less than Celery's own empty task."
    else:
        text += ": what the fleet adds on top of Celery's empty task is the difference."
    if lean:
        text += (
            f" Without events (Flower then sees no request) stock Celery's empty task runs {fmt(lean['qps'], 0)} "
            f"req/s at {fmt(lean['total_cpu_ms'], 2)} CPU-ms per request."
        )
    return text


def ceiling_section(results: dict[str, Any]) -> str:
    """The ``### Per path`` part of Dispatch cost from the run's ``dispatch`` figures: paths table, the
    gateway's commands, the lone-request profile, what Celery itself costs (each part only when measured)."""
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
    gw = d.get("gateway")
    if gw:
        out.append(
            f"Gateway: callers poll `GET /v1/requests/{{id}}` from 2 ms, backing off ×1.5 to 20 ms "
            f"({gw['polls_per_request']} GETs per request); Redis commands per request: "
            + ", ".join(f"`{k}` {v}" for k, v in gw["redis_calls_per_request"].items())
            + "\n"
        )
    gw_wait = d.get("gateway_wait")
    if gw_wait:
        out.append(
            f"Gateway, long-poll: callers `GET /v1/requests/{{id}}?wait_s={gw_wait['long_poll_s']:g}` once; the "
            f"gateway answers when the result is stored ({gw_wait['polls_per_request']} GETs per request); Redis "
            "commands per request: "
            + ", ".join(f"`{k}` {v}" for k, v in gw_wait["redis_calls_per_request"].items())
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
    lean = summary["paths"].get("lean")
    if lean:
        out.append(floor_note(lean) + "\n")
    stock = celery_floor_note(summary)
    if stock:
        out.append(stock + "\n")
    return "\n".join(out)
