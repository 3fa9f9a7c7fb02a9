"""Measurement-only prototype of a bulk path: many requests per Celery message, one result per request.

It prices the proposal in ``docs/benchmarks.md`` without touching the fleet's code. The worker
side registers ``fleet.infer_many`` on the fleet's own app (loaded by :mod:`bench.lean_worker`
when ``BENCH_BULK=1``): one message carries N requests and their IDs; each request goes through
the fleet's unchanged :func:`workers.pipeline.handle_request` (validation, scheduler, engine), and
all N results are written under their own IDs (``celery-task-meta-<id>``, SETEX + PUBLISH) in one
Redis pipeline. The client side sends one message per chunk and waits for the chunk's N results
on one pub/sub subscription, decoding each with :func:`protocol.messages.decode_result`, so a
result still reads exactly as a normal request's result does.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from celery import Celery

from bench.load import ClosedLoopRun
from bench.stats import RequestRecord
from producer.client import FleetClient
from protocol.keys import REQUEST_KEY
from protocol.messages import decode_result

__all__ = ["BULK_TASK", "bulk_closed_loop", "register_bulk_task"]

BULK_TASK = "fleet.infer_many"


def register_bulk_task(app: Celery, threads: int = 64) -> None:
    """Register ``fleet.infer_many(payloads, request_ids)`` on the fleet's worker app."""
    from workers.runtime import current_runtime
    from workers.pipeline import handle_request

    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="bulk-item")

    @app.task(name=BULK_TASK, bind=True, acks_late=True, ignore_result=True)  # type: ignore[untyped-decorator]
    def infer_many(self: Any, payloads: list[dict[str, Any]], request_ids: list[str]) -> None:
        runtime = current_runtime()
        assert runtime is not None
        worker = str(self.request.hostname or runtime.hostname)
        futures = [
            pool.submit(handle_request, runtime, p, request_id=rid, worker=worker)
            for p, rid in zip(payloads, request_ids, strict=True)
        ]
        backend = self.app.backend
        with backend.client.pipeline(transaction=False) as pipe:
            for rid, fut in zip(request_ids, futures, strict=True):
                try:
                    result, state = fut.result(), "SUCCESS"
                except Exception as exc:  # one request's failure is its own result
                    result, state = backend.prepare_exception(exc), "FAILURE"
                meta = {"status": state, "result": result, "traceback": None, "children": [],
                        "date_done": backend.app.now().isoformat(), "task_id": rid}  # fmt: skip
                value = backend.encode(meta)
                key = backend.get_key_for_task(rid)
                pipe.setex(key, backend.expires, value)
                pipe.publish(key, value)
            pipe.execute()


def _chunk(client: FleetClient, model: str, seqs: Sequence[Sequence[int]], waiter: Any) -> list[RequestRecord]:
    start = time.perf_counter()
    requests = [client.build_request(model, s) for s in seqs]
    rids = [r.request_id or uuid.uuid4().hex for r in requests]
    client.admission.admit(model, count=len(requests))  # once per message
    with client.redis.pipeline(transaction=False) as markers:  # the per-request "queued" markers, one round trip
        for r, rid in zip(requests, rids, strict=True):
            markers.set(REQUEST_KEY.format(id=rid), json.dumps({"model": r.model}), ex=client.settings.result_ttl_s)
        markers.execute()
    keys = {f"celery-task-meta-{rid}": i for i, rid in enumerate(rids)}
    waiter.subscribe(*keys)
    client.app.send_task(
        BULK_TASK,
        args=[[r.model_dump(mode="json", exclude_none=True) for r in requests], rids],
        queue=client.settings.queue_for(model),
    )
    done: dict[int, RequestRecord] = {}
    deadline = time.monotonic() + 60
    while len(done) < len(rids) and time.monotonic() < deadline:
        msg = waiter.get_message(timeout=1.0)
        if not msg or msg.get("type") != "message":
            continue
        i = keys[msg["channel"].decode()]
        meta = json.loads(msg["data"])
        if meta["status"] != "SUCCESS":
            done[i] = RequestRecord(start, time.perf_counter(), len(seqs[i]), error=str(meta["result"]))
            continue
        done[i] = RequestRecord.from_result(start, time.perf_counter(), decode_result(meta["result"]))
    waiter.unsubscribe(*keys)
    return [done.get(i) or RequestRecord(start, time.perf_counter(), len(s), error="timeout") for i, s in
            enumerate(seqs)]  # fmt: skip


def bulk_closed_loop(
    client: FleetClient, model: str, prompts: Sequence[Sequence[int]], *, clients: int, chunk: int, duration_s: float
) -> ClosedLoopRun:
    """``clients`` threads, each sending ``chunk`` requests per message and waiting for all of them."""
    lock = threading.Lock()
    records: list[RequestRecord] = []
    counter = iter(range(10**9))
    stop_at = time.perf_counter() + duration_s

    def loop() -> None:
        waiter = client.redis.pubsub(ignore_subscribe_messages=True)
        try:
            while time.perf_counter() < stop_at:
                with lock:
                    n = next(counter)
                seqs = [prompts[(n * chunk + j) % len(prompts)] for j in range(chunk)]
                recs = _chunk(client, model, seqs, waiter)
                with lock:
                    records.extend(recs)
        finally:
            waiter.close()

    threads = [threading.Thread(target=loop, name=f"bulk-client-{i}", daemon=True) for i in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return ClosedLoopRun(sorted(records, key=lambda r: r.submit_s), None)
