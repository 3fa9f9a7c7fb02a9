"""Real worker subprocesses serving real ONNX models through real Redis."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from celery import Celery

from protocol.messages import InferenceResult
from tests.integration.fleet_fixtures import Fleet

MIXED_LENGTHS = [1, 3, 17, 64, 5, 40, 2, 128]


def _ids(length: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(3, 500, size=length)]


def _ok(result: object) -> InferenceResult:
    assert isinstance(result, InferenceResult), result
    return result


def test_worker_logs_cpu_provider_and_answers_text(fleet: Fleet) -> None:
    cfg = fleet.config()
    worker = fleet.worker(cfg)
    assert "ACTIVE ['CPUExecutionProvider']" in worker.log_tail(20000)
    client = fleet.client(cfg)
    rid = client.submit("demo-lm", text="hello fleet", top_k=4, request_id="text-1")
    assert rid == "text-1"
    result = client.result(rid, wait=True, timeout_s=30)
    assert result is not None
    assert result.request_id == "text-1" and result.model == "demo-lm" and result.version == "1.0.0"
    assert result.input_tokens == len(b"hello fleet")
    assert result.top_k is not None and len(result.top_k) == 4
    logprobs = [t.logprob for t in result.top_k]
    assert logprobs == sorted(logprobs, reverse=True) and all(lp <= 0 for lp in logprobs)
    assert result.timings.worker == worker.hostname and result.timings.batch_size >= 1


def _batched_then_alone(fleet: Fleet, model: str, **submit_opts: object) -> tuple[list[InferenceResult],
                                                                                  list[InferenceResult]]:
    # a long window that only a full batch closes: the 8 mixed-length requests must share one batch
    cfg = fleet.config(models={model: {"batching": {"max_batch_size": 8, "max_wait_ms": 300,
                                                    "close_when_idle": False}}},
                       worker={"model": model})
    fleet.worker(cfg, model=model)
    client = fleet.client(cfg)
    seqs = [_ids(n, i) for i, n in enumerate(MIXED_LENGTHS)]
    batched_ids = client.submit_many(model, seqs, progress=False, **submit_opts)
    batched = [_ok(r) for r in client.wait(batched_ids, 60)]
    alone = []
    for seq in seqs:  # one at a time: each waits out the window alone
        alone.append(_ok(client.result(client.submit(model, seq, **submit_opts), wait=True, timeout_s=30)))
    assert all(r.timings.batch_size == 1 for r in alone)
    assert max(r.timings.batch_size for r in batched) == 8, [r.timings.batch_size for r in batched]
    return batched, alone


def test_padding_never_changes_lm_results(fleet: Fleet) -> None:
    batched, alone = _batched_then_alone(fleet, "demo-lm", top_k=8)
    for b, a in zip(batched, alone, strict=True):
        assert b.top_k is not None and a.top_k is not None
        assert [t.token_id for t in b.top_k] == [t.token_id for t in a.top_k]
        diff = np.abs(np.array([t.logprob for t in b.top_k]) - np.array([t.logprob for t in a.top_k]))
        assert diff.max() <= 1e-4, diff


def test_padding_never_changes_embeddings(fleet: Fleet) -> None:
    batched, alone = _batched_then_alone(fleet, "demo-encoder")
    for b, a in zip(batched, alone, strict=True):
        assert b.embedding is not None and a.embedding is not None
        vb, va = np.array(b.embedding), np.array(a.embedding)
        assert np.linalg.norm(vb) == np.float64(np.linalg.norm(vb))  # finite
        assert abs(np.linalg.norm(vb) - 1.0) < 1e-5
        assert np.abs(vb - va).max() <= 1e-4


def test_64_concurrent_requests_form_batches(fleet: Fleet) -> None:
    # a 20 ms window that stays open for late arrivals: on this tiny model one batch computes in ~1 ms,
    # faster than Celery hands over the next message, so an always-eager window would mostly run alone
    cfg = fleet.config(models={"demo-lm": {"batching": {"max_batch_size": 8, "max_wait_ms": 20,
                                                        "close_when_idle": False}}})
    fleet.worker(cfg, concurrency=8)
    client = fleet.client(cfg)
    seqs = [_ids(8 + i % 24, i) for i in range(64)]
    with ThreadPoolExecutor(16) as pool:
        ids = list(pool.map(lambda s: client.submit("demo-lm", s), seqs))
    results = [_ok(r) for r in client.wait(ids, 120)]
    sizes = [r.timings.batch_size for r in results]
    mean = statistics.fmean(sizes)
    print(f"64 concurrent requests, max_batch_size 8: mean batch size {mean:.2f}, max {max(sizes)}")
    assert mean > 1.0 and max(sizes) <= 8 and max(sizes) > 1


def test_plain_celery_client_gets_the_same_result_as_fleet_submit(fleet: Fleet) -> None:
    cfg = fleet.config()
    fleet.worker(cfg)
    tokens = [5, 6, 7, 8, 9]
    plain = Celery(broker=fleet.redis_url, backend=fleet.redis_url)  # knows only the URL, task and queue
    async_result = plain.send_task("fleet.infer", args=[{"model": "demo-lm", "input_ids": tokens}],
                                   queue="fleet.demo-lm")
    via_celery = async_result.get(timeout=30)
    cli = subprocess.run(
        [sys.executable, "-m", "producer.cli", "submit", "--config", str(cfg), "--model", "demo-lm",
         "--tokens", ",".join(map(str, tokens)), "--wait", "--timeout", "30"],
        capture_output=True, text=True, timeout=120, check=True)
    via_cli = json.loads(cli.stdout)
    assert via_celery["top_k"] == via_cli["top_k"]
    assert via_celery["model"] == via_cli["model"] == "demo-lm"
    assert via_celery["request_id"] == async_result.id
    result = subprocess.run(
        [sys.executable, "-m", "producer.cli", "result", "--config", str(cfg), via_cli["request_id"]],
        capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(result.stdout)["top_k"] == via_cli["top_k"]
    plain.close()
