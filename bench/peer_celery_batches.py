"""The peer: the same model served by a celery-batches worker, the usual way to micro-batch on Celery.

Self-contained on purpose: it runs in its own virtual environment (celery-batches 0.11 pins
Celery < 5.7) and imports nothing from this project, only celery, celery_batches, numpy and
onnxruntime. It consumes the fleet's own messages (task ``fleet.infer``, one JSON request per
task, from the model's queue) and stores a result of the fleet's result schema under each task
ID, so one unchanged ``FleetClient`` drives both under the same load.

Run (the bench does this)::

    PEER_REDIS_URL=redis://127.0.0.1:6379/0 PEER_MODEL_PATH=.../bench-lm-1.0.0.onnx \\
    python -m celery -A peer_celery_batches worker -P threads -c 1 --prefetch-multiplier 64 -Q fleet.bench-lm

Settings (environment): ``PEER_FLUSH_EVERY`` (batch size, default 8), ``PEER_FLUSH_INTERVAL_S``
(the buffer's flush timer, s, default 0.01), ``PEER_MAX_TOKENS`` (warm-up width, default 256),
``PEER_SPINNING`` (ORT spin-waiting, default 0). Tuned as the issue found best: threads pool,
concurrency 1, prefetch multiplier 64, spin-waiting off, acks late.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import redis
from celery import Celery, signals
from celery_batches import Batches

REDIS_URL = os.environ.get("PEER_REDIS_URL", "redis://127.0.0.1:6379/0")
MODEL_PATH = Path(os.environ.get("PEER_MODEL_PATH", "model.onnx"))
FLUSH_EVERY = int(os.environ.get("PEER_FLUSH_EVERY", "8"))
FLUSH_INTERVAL_S = float(os.environ.get("PEER_FLUSH_INTERVAL_S", "0.01"))
MAX_TOKENS = int(os.environ.get("PEER_MAX_TOKENS", "256"))
SPINNING = os.environ.get("PEER_SPINNING", "0")
READY_KEY = "bench:peer:ready:{hostname}"

app = Celery("peer", broker=REDIS_URL, backend=REDIS_URL, set_as_current=True)
app.conf.update(
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    result_accept_content=["json"],
    result_expires=600,
    worker_prefetch_multiplier=64,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    broker_transport_options={"visibility_timeout": 600},
)

_card: dict[str, Any] = json.loads(MODEL_PATH.with_suffix(".json").read_text()) if MODEL_PATH.exists() else {}
_session: ort.InferenceSession | None = None
_inputs: list[str] = []


def _load() -> ort.InferenceSession:
    global _session, _inputs
    if _session is None:
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.add_session_config_entry("session.intra_op.allow_spinning", SPINNING)
        opts.add_session_config_entry("session.inter_op.allow_spinning", SPINNING)
        opts.log_severity_level = 3
        _session = ort.InferenceSession(str(MODEL_PATH), opts, providers=["CPUExecutionProvider"])
        _inputs = [i.name for i in _session.get_inputs()]
    return _session


def _run(seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray, int]:
    """Right-pad, one forward pass, last real position → (top-k ids, log-probs, padded tokens)."""
    sess = _load()
    width = max(len(s) for s in seqs)
    ids = np.full((len(seqs), width), int(_card.get("pad_token_id", 0)), dtype=np.int64)
    for row, seq in enumerate(seqs):
        ids[row, : len(seq)] = seq
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    mask = (np.arange(width)[None, :] < lengths[:, None]).astype(np.int64)
    feeds: dict[str, np.ndarray] = {"input_ids": ids, "attention_mask": mask}
    if "position_ids" in _inputs:
        feeds["position_ids"] = np.arange(width, dtype=np.int64)[None, :] * mask
    for name in _inputs:
        if name.startswith("past_key_values."):
            feeds[name] = np.zeros((len(seqs), _card["num_heads"], 0, _card["head_dim"]), dtype=np.float32)
    (logits,) = sess.run(["logits"], feeds)
    last = np.asarray(logits)[np.arange(len(seqs)), lengths - 1].astype(np.float64)
    peak = last.max(axis=-1, keepdims=True)
    logprobs = last - peak - np.log(np.exp(last - peak).sum(axis=-1, keepdims=True))
    return logprobs, np.argsort(-logprobs, axis=-1, kind="stable"), int(ids.size)


@app.task(  # type: ignore[untyped-decorator]
    base=Batches, name="fleet.infer", flush_every=FLUSH_EVERY, flush_interval=FLUSH_INTERVAL_S, acks_late=True
)
def infer(requests: list[Any]) -> None:
    """One buffered batch of fleet requests: compute, then store each request's result."""
    started_unix = time.time()
    start = time.perf_counter()
    payloads = [r.args[0] if r.args else r.kwargs.get("request", {}) for r in requests]
    seqs = [list(p["input_ids"]) for p in payloads]
    logprobs, order, padded = _run(seqs)
    inference_ms = 1000 * (time.perf_counter() - start)
    for row, (req, payload) in enumerate(zip(requests, payloads, strict=True)):
        k = int(payload.get("output", {}).get("top_k", 5))
        top = [{"token_id": int(t), "logprob": float(logprobs[row, t])} for t in order[row, :k]]
        submitted = payload.get("submitted_at_unix_s")
        result = {
            "schema_version": 1,
            "request_id": req.id,
            "model": payload["model"],
            "version": str(_card.get("version", "0")),
            "kind": "next_token",
            "input_tokens": len(seqs[row]),
            "truncated": False,
            "top_k": top,
            "embedding": None,
            "timings": {
                "queue_wait_ms": max(0.0, 1000 * (started_unix - submitted)) if submitted else 0.0,
                "batch_wait_ms": 0.0,
                "inference_ms": round(inference_ms, 3),
                "batch_size": len(requests),
                "padded_tokens": padded,
                "worker": str(req.hostname),
            },
        }
        app.backend.mark_as_done(req.id, result, request=req)


@signals.worker_init.connect  # type: ignore[untyped-decorator]
def _warm_up(**_: Any) -> None:
    """Load the model and run the extreme shapes once before consuming (as the fleet's worker does)."""
    _run([[3]])
    _run([[3] * MAX_TOKENS for _ in range(FLUSH_EVERY)])


@signals.worker_ready.connect  # type: ignore[untyped-decorator]
def _announce(sender: Any = None, **_: Any) -> None:
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.set(READY_KEY.format(hostname=sender.hostname), json.dumps({"pid": os.getpid()}), ex=3600)
    finally:
        client.close()
