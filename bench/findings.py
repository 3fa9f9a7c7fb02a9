"""The report's conclusions on dispatch cost: why one Celery task per request stays slow, and what to do.

Every number is taken from the run's results, so a rerun rewrites the argument with its own
figures; the reasoning (which component issues which Redis command) comes from reading Celery,
kombu and the fleet's code and is stated once here.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["PROTOTYPE_NOTE", "dispatch_findings"]

_REDIS_SOURCES = (
    "producer: `SET NX` (the 'queued' marker; admission's `LLEN`×4 over the priority sub-queues only once per "
    "`admission.queue_depth_cache_ms` window, the routing state's `GET` once a second), then one pipeline of "
    "`LPUSH` (the task, Celery's own message) and `PUBLISH` (its task-sent event) (`producer/task_writer.py`), "
    "then `SUBSCRIBE`/`GET`/`UNSUBSCRIBE` to wait for the result (`producer/result_waiter.py`)",
    "worker: `BRPOP` (take), `ZADD`+`HSET` (kombu's unacked bookkeeping) and `EXISTS` (the cancel mark) in one "
    "plain pipeline (`workers/cancel_marks.py`) with `RPOP` of up to the worker's free tokens more, whose "
    "bookkeeping goes in one more pipeline (so a backed-up queue costs one `BRPOP` and one `RPOP` per batch of "
    "messages, not a `BRPOP` each: `workers/batch_take.py`), `HDEL`+`ZREM` on ack (inside the store script for "
    "a SUCCESS: "
    "`workers/store_ack.py`), the task events' `PUBLISH`es (task-received, -started, "
    "-succeeded, gathered for `celery.task_event_linger_ms` into one `task.multi` message: a fraction of a "
    "`PUBLISH` per request; `workers/event_buffer.py`), and one `EVALSHA` per stored state that runs "
    "`SET NX` + `PUBLISH` "
    "(`workers/result_backend.py`; a generation stores STARTED first, so two); the drain meter's "
    "`INCRBY`+`EXPIRE` go out twice a second, not per request (`workers/drain_meter.py`)",
)


def _f(x: float, digits: int = 0) -> str:
    return "–" if x is None or math.isnan(x) else f"{x:,.{digits}f}"


def _loop(abls: dict[str, Any], key: str) -> dict[str, Any] | None:
    entry = abls.get(key)
    return entry["loop"] if entry else None


PROTOTYPE_NOTE = (
    "Before the bulk path landed, a measurement-only prototype (one message of 16 requests, the fleet's code "
    "unchanged; retired from `bench/` once `fleet.infer_bulk` replaced it) priced the design on this machine at "
    "**740 req/s** (4.8× one task per request, 1.40 CPU-ms/request outside inference, 5.4 Redis "
    "commands/request) and **859 req/s** with lean Celery too (`fleet bench` at commit 453f92e)."
)
"""The retired prototype's figures, kept in the report (its code left ``bench/`` when the real path landed)."""


def _bulk_figures(bulk: dict[str, Any], both: dict[str, Any] | None, qps: float, cores: int) -> list[str]:
    """The bulk variant's figures: the real path's, or (older runs) the retired prototype's."""
    real = bulk.get("path") == "fleet.infer_bulk"
    how = (
        f"Measured on the landed path (`FleetClient.submit_bulk` → `fleet.infer_bulk`, "
        f"{bulk.get('requests_per_message')} requests per message, results read with `FleetClient.wait`)"
        if real
        else f"Measured with a prototype ({bulk.get('requests_per_message')} requests per message, the fleet's code "
        "unchanged; retired from `bench/` since the real path replaced it)"
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
        if real
        else "`handle_request`'s cancel-key `EXISTS` round trip, pydantic decode/validate/encode and a thread "
        "hand-off per request. The landed path checks a chunk's cancel keys with one `MGET` and submits its jobs "
        "at once"
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
        "Proposed from the figures above and since landed as `fleet.infer_bulk` next to `fleet.infer`: "
        "`FleetClient.submit_bulk` sends up to `chunk_size` requests per message. The worker checks the chunk's "
        "cancel keys with one `MGET`, validates each request on its own (a bad request fails alone), hands all "
        "valid ones to the scheduler at once and writes every result under its own ID "
        "(`celery-task-meta-<id>`, `SETEX`+`PUBLISH`) in one pipeline, so `FleetClient.result(id)` and "
        "`GET /v1/requests/{id}` are unchanged. What is paid per message — `LPUSH`, `BRPOP`, QoS bookkeeping, "
        "ack, three events, the STARTED state, Celery's tracer — is shared by the whole chunk; a chunk holds one "
        "token per request. Trade-offs: Flower shows chunks, `revoke` works per chunk (per-request cancel keeps "
        "working through the cancel key), and a redelivered chunk recomputes all its requests (harmless: results "
        "are pure functions of the request).",
    ]
    if bulk:
        lines += _bulk_figures(bulk, both, qps, cores)
    if not bulk or bulk.get("path") == "fleet.infer_bulk":
        lines.append("\n" + PROTOTYPE_NOTE)
    lines += [
        "",
        "Changes, measured in the before/after table below (the old path runs beside the new one in the same "
        "run: `bench/legacy_client.py`, `bench/legacy_worker.py`): the producer reuses a queue-depth read for "
        "`admission.queue_depth_cache_ms` (`LLEN`×4 once per window instead of per submit), goes straight to "
        "`SET NX` (no look-up first), skips Celery's send-time result subscription, writes the task and its "
        "task-sent event in one pipeline built by Celery's and kombu's own code instead of `send_task` "
        "(`producer/task_writer.py`), and waits with one pub/sub per thread instead of `AsyncResult.get` "
        "(`producer/result_waiter.py`); kombu's channel reuses one Redis client instead of building one per "
        "command and sends each delivery's bookkeeping as a plain pipeline instead of `MULTI`/`EXEC` "
        "(`protocol/kombu_channel.py`); the worker stores each result with one script instead of `GET` + "
        "`MULTI`/`SETEX`/`PUBLISH`/`EXEC` (`workers/result_backend.py`, which also makes the keep-a-SUCCESS check "
        "atomic), writes the drain meter twice a second (`workers/drain_meter.py`) and publishes its task events "
        "from a thread of their own, gathered for 20 ms, instead of on the consumer's loop every 2-3 events "
        "(`workers/event_buffer.py`); the "
        "result waiter reads the key only once Redis has confirmed its `SUBSCRIBE` (a result stored in between "
        "had waited for the 5 s recheck); the worker reads each request's cancel mark in the pipeline that takes "
        "the message instead of one more `EXISTS` round trip (`workers/cancel_marks.py`), and acks a SUCCESS "
        "inside the script that stores it, in one atomic step, instead of one more `HDEL`+`ZREM` round trip "
        "(`workers/store_ack.py`); with the queue backed up, it takes up to its free tokens per round trip "
        "(`BRPOP`, then `RPOP` of as many more as it has tokens free, their bookkeeping in one pipeline) instead "
        "of one message per turn of its event loop, which had left it holding 2.6 requests of 16 on average "
        "while 27 waited in Redis (`workers/batch_take.py`); `result_extended` is off "
        "(nothing read it); task events and the STARTED state are settings (`celery.task_events`, "
        "`celery.track_started`), each priced above.",
    ]
    return "\n".join(lines) + "\n"
