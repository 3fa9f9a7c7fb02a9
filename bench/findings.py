"""The report's conclusions on dispatch cost: why one Celery task per request stays slow, and what to do.

Every number is taken from the run's results, so a rerun rewrites the argument with its own
figures; the reasoning (which component issues which Redis command) comes from reading Celery,
kombu and the fleet's code and is stated once here.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["dispatch_findings"]

_REDIS_SOURCES = (
    "producer: one `EVALSHA` of its claim-and-queue script (`producer/idempotent_queue.py`), which runs `SET NX` "
    "(the request ID's marker), `EXISTS` (a stored result whose marker expired), `LPUSH` (the task, Celery's own "
    "message) and `PUBLISH` (its task-sent event) in one atomic step; admission's `LLEN`×4 over the priority "
    "sub-queues only once per `admission.queue_depth_cache_ms` window and the routing state's `GET` once a second; "
    "then `SUBSCRIBE`/`GET`/`UNSUBSCRIBE` to wait for the result (`producer/result_waiter.py`)",
    "worker: a `BLMOVE` of the list onto itself that waits for a message without taking it, then one `EVALSHA` "
    "of its take script (`broker/atomic_take.py`) that reads up to its free tokens of the oldest messages "
    "(`LRANGE`), records each as unacked (`ZADD`+`HSET`, kombu's bookkeeping), reads each cancel mark (`EXISTS`) "
    "and trims them off the list (`LTRIM`), so a message is at every instant in its queue or in the unacked hash, "
    "and a backed-up queue costs one wait and one script per batch of messages, not per message; one `EVALSHA` per "
    "stored state that runs `SET` + `PUBLISH` and, for a SUCCESS, the ack's `HDEL`+`ZREM` "
    "(`broker/result_backend.py`, `broker/store_ack.py`; a generation stores STARTED first, so two); the task "
    "events' `PUBLISH`es (task-received, -started, -succeeded, gathered for `celery.task_event_linger_ms` into one "
    "`task.multi` message: a fraction of a `PUBLISH` per request; `broker/event_buffer.py`); the drain meter's "
    "`INCRBY`+`EXPIRE` twice a second, not per request (`workers/drain_meter.py`). Redis counts the commands a "
    "script runs as commands of their own, so each script is its `EVALSHA` plus what it runs",
)


def _f(x: float, digits: int = 0) -> str:
    return "–" if x is None or math.isnan(x) else f"{x:,.{digits}f}"


def _loop(abls: dict[str, Any], key: str) -> dict[str, Any] | None:
    entry = abls.get(key)
    return entry["loop"] if entry else None


def _bulk_figures(bulk: dict[str, Any], both: dict[str, Any] | None, qps: float, cores: int) -> list[str]:
    """The bulk path's figures (``fleet.infer_bulk`` through ``FleetClient.submit_bulk``)."""
    how = (
        f"Measured through `FleetClient.submit_bulk` → `fleet.infer_bulk` ({bulk.get('requests_per_message')} "
        "requests per message, results read with `FleetClient.wait`)"
    )
    lines = [
        f"\n{how}: **{_f(bulk['summary']['qps'])} req/s** ({bulk['summary']['qps'] / qps:.1f}× one task per "
        f"request), {_f(bulk['cpu_ms_outside_inference'], 2)} CPU-ms/request outside inference, "
        f"{_f(bulk['redis_calls_total_per_request'], 1)} Redis commands/request"
        + (
            f"; with lean Celery too: **{_f(both['summary']['qps'])} req/s**, "
            f"{_f(both['cpu_ms_outside_inference'], 2)} CPU-ms/request."
            if both
            else "."
        )
    ]
    best = max(float(bulk["summary"]["qps"]), float(both["summary"]["qps"]) if both else 0.0)
    bcpu = bulk["cpu_ms_per_request"]
    left = (
        "pydantic decode/validate/encode of each request and result, the scheduler hand-off, and each result's "
        "`SETEX`+`PUBLISH` (pipelined)"
    )
    lines.append(
        "That reaches the 1,000 req/s goal on this machine."
        if best >= 1000
        else f"Even that stays below 1,000 req/s on this {cores}-core machine, where producer, Redis and worker "
        f"share the cores: what is left is per request — worker {_f(bcpu['worker'], 2)}, producer "
        f"{_f(bcpu['producer'], 2)}, Redis {_f(bcpu['redis'], 2)} CPU-ms: {left}; validating in the producer only "
        "(the worker re-checks limits, not the schema) is the next step; a worker with Redis and producers on "
        f"other machines would carry about {_f(1000 / max(1e-9, float(bcpu['worker'])))} req/s per core."
    )
    return lines


def dispatch_findings(results: dict[str, Any]) -> str:
    """Markdown: the measured reasons, and the bulk path with its measured figures."""
    d = results.get("dispatch") or {}
    loop = d.get("loop")
    if not loop:
        return ""
    cpu = loop["cpu_ms_per_request"]
    total = sum(cpu.values())
    cores = results["meta"]["machine"]["logical_cores"] or 1
    qps = float(loop["summary"]["qps"])
    abls = d.get("ablations") or {}
    lean, bulk, both = _loop(abls, "lean"), _loop(abls, "bulk"), _loop(abls, "bulk+lean")
    lines = [
        "### Why one task per request cannot reach 1,000 req/s here\n",
        f"- **CPU, not waiting, is the limit.** Each request costs {_f(total, 1)} CPU-ms in all, "
        f"{_f(loop['cpu_ms_outside_inference'], 1)} of them outside inference "
        f"(producer {_f(cpu['producer'], 1)}, Redis {_f(cpu['redis'], 1)}, worker {_f(cpu['worker'], 1)}). "
        f"On {cores} cores that caps the whole path near {_f(cores * 1000 / total)} req/s with a zero-cost "
        f"model; the loop reached {_f(qps)}. 1,000 req/s would need ≤ {_f(cores, 0)} CPU-ms per request in all "
        "three processes together.",
        f"- **{_f(loop['redis_calls_total_per_request'], 0)} Redis commands per request**, each a system call "
        "pair on both sides: " + "; ".join(_REDIS_SOURCES) + ".",
    ]
    prof = d.get("profile") or {}
    worker = (prof.get("worker") or {}).get("components") or {}
    if worker:
        celery = max(
            worker.get("Celery task tracing (celery.app.trace)", 0.0),
            worker.get("Celery worker/consumer (celery.worker)", 0.0),
        )
        store = worker.get("result store (celery.backends)", 0.0)
        events = worker.get("task events (celery.events)", 0.0)
        engine = worker.get("ONNX Runtime session.run", 0.0)
        lines.append(
            f"- **The worker's Python time is Celery's per-task machinery**: ≥ {_f(100 * celery)} % of its "
            f"GIL-holding samples run inside Celery's consumer/tracer, {_f(100 * store)} % in the result store, "
            f"{_f(100 * events)} % in task events, only {_f(100 * engine)} % in `session.run`. One process has "
            "one GIL, so this per-message work serialises, however many task threads hold tokens."
        )
    if lean:
        saved = 1 - float(lean["cpu_ms_outside_inference"]) / max(1e-9, float(loop["cpu_ms_outside_inference"]))
        cost = (f"cost {_f(100 * saved)} % of it" if saved >= 0.02
                else "cost nothing measurable here (within this machine's run-to-run spread)")
        lines.append(
            f"- **Celery's per-task extras {cost}.** With task events, the STARTED state "
            f"and extended results off, the same loop ran {_f(lean['summary']['qps'])} req/s "
            f"({lean['summary']['qps'] / qps:.2f}×) at {_f(lean['cpu_ms_outside_inference'], 1)} CPU-ms/request."
        )
    lone = (d.get("lone") or {}).get("latency", {}).get("p50_ms")
    if lone:
        lines.append(
            f"- **The same cost is the lone request's overhead**: the identity model's round trip is "
            f"{_f(lone, 1)} ms at p50, which is what a lone request adds to one bare `session.run` (see Targets)."
        )
    lines += [
        "",
        "### The bulk path — many requests per message, one result per request\n",
        "`fleet.infer_bulk`, next to `fleet.infer`, answers the figures above: "
        "`FleetClient.submit_bulk` sends up to `chunk_size` requests per message. The worker checks the chunk's "
        "cancel keys with one `MGET`, validates each request on its own (a bad request fails alone), hands all "
        "valid ones to the scheduler at once and writes every result under its own ID "
        "(`celery-task-meta-<id>`, `SETEX`+`PUBLISH`) in one pipeline, so `FleetClient.result(id)` and "
        "`GET /v1/requests/{id}` are unchanged. What is paid per message — `LPUSH`, the take, QoS bookkeeping, "
        "ack, three events, the STARTED state, Celery's tracer — is shared by the whole chunk; a chunk holds one "
        "token per request. Trade-offs: Flower shows chunks, `revoke` works per chunk (per-request cancel keeps "
        "working through the cancel key), and a redelivered chunk recomputes all its requests (harmless: results "
        "are pure functions of the request).",
    ]
    if bulk:
        lines += _bulk_figures(bulk, both, qps, cores)
    return "\n".join(lines) + "\n"
