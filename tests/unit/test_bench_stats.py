"""Pure parts of the bench and of the quantization report: statistics (generation included), KL, profiles,
formatting."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.analysis import target_rows
from bench.findings import dispatch_findings
from bench.genreport import generation_target
from bench.genstats import GenRecord, arrival_offsets, metric_delta, parse_metrics, step_shares, summarize_generation
from bench.notes import last_position_note
from bench.plots import latency_points
from bench.profile import fold_components, parse_raw, top_functions
from bench.report import fmt, md_table, mib, provenance
from bench.stats import (
    RequestRecord,
    batch_figures,
    percentile,
    poisson_arrivals,
    summarize_latencies,
    summarize_run,
    summarize_runs,
)
from protocol.messages import Generation, GenerationTimings, InferenceResult, Timings, Usage
from tools.quant_accuracy import compare_embeddings, compare_logits, log_softmax


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([5.0], 50, 5.0),
        ([1.0, 2.0, 3.0, 4.0], 0, 1.0),
        ([1.0, 2.0, 3.0, 4.0], 100, 4.0),
        ([1.0, 2.0, 3.0, 4.0], 50, 2.5),
        ([4.0, 1.0, 3.0, 2.0], 50, 2.5),
        ([0.0, 10.0], 99, 9.9),
        (list(range(101)), 95, 95.0),
    ],
)
def test_percentile_table(values: list[float], q: float, expected: float) -> None:
    assert percentile(values, q) == pytest.approx(expected)


def test_percentile_matches_numpy() -> None:
    rng = np.random.default_rng(0)
    values = rng.exponential(10.0, size=257).tolist()
    for q in (1, 25, 50, 90, 95, 99, 99.9):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


@pytest.mark.parametrize(("values", "q"), [([], 50), ([1.0], -1), ([1.0], 100.5)])
def test_percentile_rejects(values: list[float], q: float) -> None:
    with pytest.raises(ValueError):
        percentile(values, q)


def test_summarize_latencies() -> None:
    s = summarize_latencies([10.0, 20.0, 30.0, 40.0])
    assert (s.count, s.mean_ms, s.p50_ms, s.max_ms) == (4, 25.0, 25.0, 40.0)
    assert s.p99_ms == pytest.approx(39.7)
    empty = summarize_latencies([])
    assert empty.count == 0 and math.isnan(empty.p50_ms)


def _rec(
    submit: float, done: float, tokens: int, batch: int, padded: int, error: str | None = None, *,
    engine_ms: float = 1.0, queue_wait_ms: float = 0.0,
) -> RequestRecord:
    return RequestRecord(submit, done, tokens, batch, padded, engine_ms, queue_wait_ms, error=error)


def test_batch_figures_exact_totals() -> None:
    # batch A: 2 requests (3 and 5 tokens) padded to 2 x 5 = 10; batch B: 1 request of 4 tokens.
    recs = [_rec(0, 1, 3, 2, 10), _rec(0, 1, 5, 2, 10), _rec(0, 1, 4, 1, 4)]
    mean_batch, padding = batch_figures(recs)
    assert mean_batch == pytest.approx(3 / 2)  # 3 requests in 2 batches
    assert padding == pytest.approx((3 + 5 + 4) / (10 + 4))


def test_batch_figures_ignore_failures_and_unknown() -> None:
    recs = [_rec(0, 1, 3, 0, 0), _rec(0, 1, 3, 1, 3, error="boom")]
    mean_batch, padding = batch_figures(recs)
    assert math.isnan(mean_batch) and math.isnan(padding)


def test_summarize_run_window_counts_steady_state_only() -> None:
    recs = [_rec(0.0, 0.5, 4, 1, 4), _rec(0.5, 1.5, 4, 1, 4), _rec(1.5, 2.5, 4, 1, 4), _rec(2.5, 3.5, 4, 1, 4)]
    whole = summarize_run(recs)
    assert whole.requests == 4 and whole.qps == pytest.approx(4 / 3.5)
    steady = summarize_run(recs, window=(1.0, 3.0))  # completions at 1.5 and 2.5
    assert steady.requests == 2 and steady.qps == pytest.approx(1.0)
    assert steady.latency.p50_ms == pytest.approx(1000.0)


def test_summarize_runs_pools_windows_and_littles_law() -> None:
    # two rounds of a 4-client closed loop; every request takes 0.5 s, so X = 4 / 0.5 s = 8 req/s.
    a = [_rec(t, t + 0.5, 4, 2, 8) for t in (0.0, 0.5, 1.0)]
    b = [_rec(t, t + 0.5, 4, 2, 8) for t in (10.0, 10.5)]
    pooled = summarize_runs([(a, (0.0, 2.0)), (b, (10.0, 11.0))], clients=4)
    assert pooled.requests == 5 and pooled.window_s == pytest.approx(3.0)
    assert pooled.qps == pytest.approx(8.0) and pooled.qps_counted == pytest.approx(5 / 3)
    plain = summarize_runs([(a, (0.0, 2.0)), (b, (10.0, 11.0))])
    assert plain.qps == pytest.approx(5 / 3) and math.isnan(plain.qps_counted)


def test_summarize_run_counts_errors() -> None:
    s = summarize_run([_rec(0, 1, 4, 1, 4), _rec(0, 2, 4, 0, 0, error="x")])
    assert (s.requests, s.errors) == (1, 1)


def test_summarize_run_splits_the_workers_time() -> None:
    recs = [_rec(0, 1, 4, 1, 4, engine_ms=e, queue_wait_ms=q) for e, q in ((50.0, 3.0), (60.0, 5.0), (70.0, 4.0))]
    s = summarize_run([*recs, _rec(0, 1, 4, 0, 0, error="x", engine_ms=999.0, queue_wait_ms=999.0)])
    assert s.engine_p50_ms == pytest.approx(60.0) and s.queue_wait_p50_ms == pytest.approx(4.0)
    assert math.isnan(summarize_run([]).engine_p50_ms)


def test_poisson_arrivals_rate_and_determinism() -> None:
    a = poisson_arrivals(200.0, 50.0, seed=3)
    assert a == poisson_arrivals(200.0, 50.0, seed=3)
    assert a != poisson_arrivals(200.0, 50.0, seed=4)
    assert all(0 < x < 50.0 for x in a) and a == sorted(a)
    assert len(a) / 50.0 == pytest.approx(200.0, rel=0.05)
    gaps = np.diff(a)
    assert float(np.std(gaps)) == pytest.approx(float(np.mean(gaps)), rel=0.1)  # exponential: sd = mean


@pytest.mark.parametrize(("rate", "duration"), [(0.0, 1.0), (1.0, 0.0), (-1.0, 5.0)])
def test_poisson_arrivals_rejects(rate: float, duration: float) -> None:
    with pytest.raises(ValueError):
        poisson_arrivals(rate, duration, seed=0)


def test_log_softmax_normalizes() -> None:
    lp = log_softmax(np.array([[1.0, 2.0, 3.0], [1000.0, 1000.0, -1000.0]]))
    assert np.allclose(np.exp(lp).sum(axis=-1), 1.0)
    assert lp[1, 0] == pytest.approx(math.log(0.5))


def test_compare_logits_identical_is_perfect() -> None:
    x = np.random.default_rng(0).normal(size=(8, 50))
    rep = compare_logits(x, x)
    assert rep.top1_agreement == 1.0 and rep.mean_kl == pytest.approx(0.0, abs=1e-12)
    assert rep.max_abs_delta_logprob == pytest.approx(0.0, abs=1e-12)


def test_compare_logits_known_values() -> None:
    ref = np.log(np.array([[0.5, 0.25, 0.25], [0.1, 0.2, 0.7]]))
    cand = np.log(np.array([[0.25, 0.5, 0.25], [0.1, 0.2, 0.7]]))
    rep = compare_logits(ref, cand)
    assert rep.top1_agreement == 0.5
    kl_row0 = 0.5 * math.log(0.5 / 0.25) + 0.25 * math.log(0.25 / 0.5) + 0.0
    assert rep.mean_kl == pytest.approx(kl_row0 / 2)
    assert rep.max_abs_delta_logprob == pytest.approx(math.log(2))
    assert rep.max_abs_delta_logprob_top5 == pytest.approx(math.log(2))


def test_compare_embeddings_known_values() -> None:
    ref = np.array([[1.0, 0.0], [3.0, 4.0], [0.0, 0.0]])
    cand = np.array([[1.0, 1.0], [6.0, 8.0], [0.0, 0.0]])  # 45 degrees off; the same direction twice as long; zero
    rep = compare_embeddings(ref, cand)
    assert rep.prompts == 3 and rep.min_cosine == pytest.approx(math.sqrt(0.5))
    assert rep.mean_cosine == pytest.approx((math.sqrt(0.5) + 1.0 + 1.0) / 3)  # a zero row counts as agreeing
    assert rep.max_abs_delta == pytest.approx(4.0 / 4.0)  # |8 - 4| over the largest |reference|
    with pytest.raises(ValueError, match=r"\[n, dim\]"):
        compare_embeddings(ref, cand[:2])


def test_compare_logits_shift_invariant() -> None:
    x = np.random.default_rng(1).normal(size=(4, 10))
    assert compare_logits(x, x + 7.5).mean_kl == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize(("a", "b"), [((2, 3), (2, 4)), ((0, 3), (0, 3)), ((3,), (3,))])
def test_compare_logits_rejects_shapes(a: tuple[int, ...], b: tuple[int, ...]) -> None:
    with pytest.raises(ValueError):
        compare_logits(np.zeros(a), np.zeros(b))


_ORT = "onnxruntime/capi/onnxruntime_inference_collection.py"
RAW = (
    "<module> (celery/bin/worker.py:1);run (celery/app/trace.py:10);store (celery/backends/redis.py:5) 30\n"
    f"<module> (celery/bin/worker.py:1);run (celery/app/trace.py:10);run ({_ORT}:3) 50\n"
    "<module> (celery/bin/worker.py:1);emit (/usr/lib/python3.11/logging/__init__.py:9) 20\n"
    "not a stack line\n"
)


def test_profile_parse_and_fold() -> None:
    stacks = parse_raw(RAW)
    assert len(stacks) == 3 and stacks[0][1] == 30
    assert stacks[0][0][-1] == ("store", "celery/backends/redis.py")
    total, shares = fold_components(stacks)
    assert total == 100
    assert shares["ONNX Runtime session.run"] == pytest.approx(0.5)
    assert shares["result store (celery.backends)"] == pytest.approx(0.3)
    assert shares["Celery task tracing (celery.app.trace)"] == pytest.approx(0.8)
    assert shares["logging"] == pytest.approx(0.2)
    assert shares["pydantic validation"] == 0.0
    top = top_functions(stacks, 2)
    assert top[0][0].startswith("run (onnxruntime_inference_collection.py") and top[0][1] == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("value", "digits", "text"),
    [(None, 1, "–"), (float("nan"), 1, "–"), (1234.5678, 1, "1,234.6"), (0.5, 2, "0.50"), ("x", 1, "x"), (3, 0, "3")],
)
def test_fmt(value: object, digits: int, text: str) -> None:
    assert fmt(value, digits) == text


def test_mib_and_table() -> None:
    assert mib(None) == "–" and mib(3 * 2**20) == "3.0"
    table = md_table(["a", "b"], [["1", "x|y"]])
    assert table.splitlines() == ["| a | b |", "|---|---|", "| 1 | x\\|y |"]


def _summary(qps: float, p50: float, p99: float, requests: int = 10) -> dict[str, object]:
    return {"requests": requests, "qps": qps, "latency": {"p50_ms": p50, "p99_ms": p99}}


def test_latency_points_sorted_and_skip_empty() -> None:
    entry = {
        "lone": _summary(5, 10, 12),
        "open": [{"summary": _summary(20, 15, 30)}, {"summary": _summary(0, 0, 0, requests=0)}],
        "saturation": _summary(40, 50, 90),
    }
    assert latency_points(entry) == [(5.0, 10.0, 12.0), (20.0, 15.0, 30.0), (40.0, 50.0, 90.0)]


def _row(qps: float, p99: float, lone_p50: float, **lone_split: float) -> dict[str, object]:
    sat = {"qps": qps, "latency": {"p99_ms": p99}}
    wl = {"saturation": sat, "lone": {"latency": {"p50_ms": lone_p50}, **lone_split}}
    return {"status": "ok", "workloads": {"long": wl, "short": wl}}


def test_target_rows_report_met_and_not_met() -> None:
    limit = {
        "points": [{"batch_size": 8, "qps": 100.0}],
        "best": {"batch_size": 8, "qps": 100.0},
        "bare_lone_ms": 10.0,
    }
    results = {
        "meta": {"plan": {"max_batch_size": 8}},
        "limit": {"fp32": {"long": limit, "short": limit}, "int8": {"long": limit, "short": limit}},
        "rows": {
            "batching": _row(96.0, 50.0, 14.0, queue_wait_p50_ms=2.5, engine_p50_ms=9.25),
            "int8": _row(120.0, 40.0, 9.0),
            "peer": _row(80.0, 60.0, 60.0),
        },
        "models": {
            "variants": {"dynamic": {"sizes": {"ratio": 0.25}, "accuracy": {"top1_agreement": 0.95, "mean_kl": 0.01}}}
        },
        "dispatch": {"loop": {"summary": {"qps": 400.0}, "cpu_ms_outside_inference": 5.0}},
    }
    measured = {(r[0], r[1]): r[2] for r in target_rows(results)}
    lone = measured[("lone request p50 within 5 ms of one bare session.run", "long")]
    assert lone == "+4.00 ms (14.00 vs 10.00 ms; in the worker: submit → batch start 2.50 ms, engine 9.25 ms)"
    rows = {(r[0], r[1]): r[3] for r in target_rows(results)}
    assert rows[("batching ≥ 95 % of the limit at batch 8", "long")] == "met"
    assert rows[("lone request p50 within 5 ms of one bare session.run", "long")] == "met"
    assert rows[("batching beats the celery-batches peer on QPS at ≤ p99", "short")] == "met"
    assert rows[("INT8 CPU throughput ≥ 1.5× FP32", "long")] == "**not met**"
    assert rows[("INT8 file ≤ 30 % of FP32", "–")] == "met"
    assert rows[("dispatch ≥ 1,000 req/s through one worker", "short")] == "**not met**"


def _loop(qps: float, producer: float, redis: float, worker: float, calls: float,
          engine_ms: float = 0.0) -> dict[str, object]:
    return {
        "summary": {"qps": qps},
        "cpu_ms_per_request": {"producer": producer, "redis": redis, "worker": worker},
        "cpu_ms_outside_inference": producer + redis + worker - engine_ms,  # as bench.dispatch computes it
        "redis_calls_total_per_request": calls,
        "requests_per_message": 1,
    }


def test_dispatch_findings_quote_the_run() -> None:
    results = {
        "meta": {"machine": {"logical_cores": 2}},
        "dispatch": {
            "loop": _loop(120.0, 5.0, 1.0, 6.0, 37.0, engine_ms=1.5),
            "ablations": {
                "lean": {"loop": _loop(185.0, 3.5, 0.6, 4.4, 29.0)},
                "bulk": {"loop": {**_loop(600.0, 1.0, 0.3, 1.5, 6.0), "requests_per_message": 16,
                                  "path": "fleet.infer_bulk"}},
            },
            "profile": {"worker": {"components": {"Celery task tracing (celery.app.trace)": 0.4}}},
        },
    }
    text = dispatch_findings(results)
    assert "12.0 CPU-ms in all, 10.5 of them outside inference" in text and "near 167 req/s" in text
    assert "37 Redis commands per request" in text
    assert "≥ 40 % of its" in text
    assert "185 req/s" in text and "(1.54×)" in text
    assert "**600 req/s** (5.0× one task per request)" in text and "stays below 1,000" in text
    assert "Measured through `FleetClient.submit_bulk`" in text and "prototype" not in text
    # the take and the queueing as the fleet does them now: BLMOVE + the take script, the producer's one script
    assert "`BLMOVE`" in text and "`broker/atomic_take.py`" in text and "`producer/idempotent_queue.py`" in text
    assert "BRPOP" not in text and "RPOP" not in text and "before/after" not in text
    assert dispatch_findings({"meta": {}, "rows": {}}) == ""


def _run_meta(commit: str = "abc1234", dirty: bool = False) -> dict[str, object]:
    machine = {"git_commit": commit, "git_dirty": dirty, "cpu": "Test CPU", "logical_cores": 2, "memory_gib": 8.0}
    return {"meta": {"machine": machine, "started_unix_s": 1_700_000_000.0}}


def test_provenance_states_the_commit_its_date_the_run_date_and_the_machine() -> None:
    text = provenance(_run_meta(), "2023-11-14")
    assert text.startswith("Measured on 2023-11-14 22:13 UTC at commit `abc1234` (committed 2023-11-14) on Test CPU")
    assert "Warning" not in text
    assert "(committed" not in provenance(_run_meta(), None)  # a commit git does not know: no date invented


def test_provenance_marks_a_dirty_tree_and_phases_of_other_runs_loudly() -> None:
    dirty = provenance(_run_meta(dirty=True), None)
    assert "**Warning: not a committed state.**" in dirty and "measured: the run." in dirty
    mixed = {**_run_meta(), "dispatch": {"meta": {"commit": "0ld0ne", "dirty": True}},
             "generation": {"meta": {"commit": "abc1234", "dirty": False}}}  # fmt: skip
    text = provenance(mixed, None)
    assert "**Warning: not one run.** dispatch was measured separately at commit `0ld0ne`" in text
    assert "generation was measured" not in text  # measured with the run: same commit
    assert "measured: dispatch." in text


def test_last_position_note() -> None:
    def lim(qps1: float, qps8: float) -> dict[str, object]:
        return {"points": [{"batch_size": 1, "qps": qps1}, {"batch_size": 8, "qps": qps8}]}

    results = {
        "meta": {"plan": {"max_batch_size": 8}},
        "limit": {"fp32": {"long": lim(10, 8)}, "fp32_last": {"long": lim(12, 12)}},
    }
    note = last_position_note(results)
    assert "FP32 long b=1: 1.20×" in note and "FP32 long b=8: 1.50×" in note
    assert last_position_note({"meta": {}, "limit": {"fp32": {}}}) == ""


def _gen(submit: float, done: float, tokens: int, ttft: float, gap: float, batch: float = 4.0) -> GenRecord:
    return GenRecord(submit, done, 10, tokens, ttft, gap, 1.0, batch)


def test_gen_record_from_result() -> None:
    result = InferenceResult(
        request_id="r", model="m", version="1", kind="generate", input_tokens=12,
        generation=Generation(
            token_ids=[5, 6, 7], text=None, finish_reason="length",
            usage=Usage(prompt_tokens=12, completion_tokens=3, total_tokens=15),
            timings=GenerationTimings(time_to_first_token_ms=40.0, mean_inter_token_ms=9.0, decode_steps=2,
                                      batch_size_min=1, batch_size_mean=2.5, batch_size_max=4),
        ),
        timings=Timings(queue_wait_ms=3.0, batch_wait_ms=1.0, inference_ms=20.0, batch_size=1, padded_tokens=12,
                        worker="w"),
    )  # fmt: skip
    rec = GenRecord.from_result(1.0, 1.5, result)
    assert (rec.prompt_tokens, rec.completion_tokens, rec.ttft_ms, rec.inter_token_ms) == (12, 3, 40.0, 9.0)
    assert (rec.queue_wait_ms, rec.batch_mean, rec.latency_ms) == (3.0, 2.5, 500.0)
    with pytest.raises(ValueError):
        GenRecord.from_result(0, 1, result.model_copy(update={"generation": None}))


def test_summarize_generation_pools_runs_by_their_spans() -> None:
    a = [_gen(0.0, 1.0, 30, 100.0, 10.0, batch=2.0), _gen(0.0, 2.0, 10, 300.0, 20.0, batch=6.0)]
    b = [_gen(10.0, 11.0, 20, 200.0, math.nan), _gen(10.0, 10.5, 0, math.nan, math.nan, batch=math.nan)]
    b.append(GenRecord(10.0, 12.0, 10, error="boom"))
    s = summarize_generation([a, b])
    assert (s.requests, s.errors, s.tokens) == (4, 1, 60)
    assert s.span_s == pytest.approx(2.0 + 2.0) and s.tokens_per_s == pytest.approx(15.0)  # 60 tokens / 4 s
    assert s.ttft.count == 3 and s.ttft.p50_ms == pytest.approx(200.0)
    assert s.inter_token.count == 2 and s.inter_token.max_ms == 20.0  # NaN gaps (one token) left out
    assert s.mean_batch == pytest.approx((2 * 30 + 6 * 10 + 4 * 20) / 60)  # token-weighted
    empty = summarize_generation([])
    assert empty.tokens_per_s == 0.0 and empty.requests == 0


def test_arrival_offsets() -> None:
    assert arrival_offsets(None, 3, seed=0) == [0.0, 0.0, 0.0]
    poisson = arrival_offsets(50.0, 2000, seed=1)
    assert poisson == arrival_offsets(50.0, 2000, seed=1) and poisson == sorted(poisson) and poisson[0] > 0
    assert 2000 / poisson[-1] == pytest.approx(50.0, rel=0.06)
    for bad in ((0.0, 3), (1.0, -1)):
        with pytest.raises(ValueError):
            arrival_offsets(*bad, seed=0)


def test_step_shares() -> None:
    steps = [
        {"prefill_ms": 30.0, "copy_ms": 10.0, "decode_ms": 60.0, "running": 4, "tokens": 8, "kv_tokens": 40,
         "kv_slots": 80},
        {"prefill_ms": 0.0, "copy_ms": 0.0, "decode_ms": 50.0, "running": 2, "tokens": 2, "kv_tokens": 30,
         "kv_slots": 40},
        {"prefill_ms": 50.0, "copy_ms": 0.0, "decode_ms": 0.0, "running": 0, "tokens": 1},
    ]  # fmt: skip
    sh = step_shares(steps)
    assert sh["step_ms_total"] == 200.0 and sh["steps"] == 3.0 and sh["tokens"] == 11.0
    assert (sh["prefill_share"], sh["copy_share"], sh["decode_share"]) == (0.4, 0.05, 0.55)
    assert sh["mean_running"] == 3.0 and sh["relayouts"] == 1.0 and sh["copy_ms_per_relayout"] == 10.0
    assert sh["kv_fill"] == pytest.approx(70 / 120)
    assert math.isnan(step_shares([])["copy_share"])


def test_parse_metrics_and_delta() -> None:
    text = (
        "# HELP fleet_worker_kv_copy_seconds KV\n# TYPE fleet_worker_kv_copy_seconds histogram\n"
        'fleet_worker_kv_copy_seconds_bucket{le="0.01",model="m"} 3.0\n'
        'fleet_worker_kv_copy_seconds_sum{model="m"} 0.25\n'
        'fleet_worker_kv_copy_seconds_sum{model="n"} 0.5\n'
        "fleet_worker_generated_tokens_total 12.0\n"
    )
    names = ("fleet_worker_kv_copy_seconds_sum", "fleet_worker_generated_tokens_total", "absent")
    values = parse_metrics(text, names)
    assert values == {"fleet_worker_kv_copy_seconds_sum": 0.75, "fleet_worker_generated_tokens_total": 12.0,
                      "absent": 0.0}  # fmt: skip
    assert metric_delta({"absent": 1.0}, values)["absent"] == -1.0


def _gen_row(tokens_per_s: float, p99: float) -> dict[str, object]:
    return {"status": "ok", "saturation": {"tokens_per_s": tokens_per_s, "ttft": {"p99_ms": p99}}}


def test_generation_target() -> None:
    gen = {"rows": {"one_at_a_time": _gen_row(100.0, 9000.0), "continuous": _gen_row(310.0, 2500.0)}}
    row = generation_target(gen)
    assert row is not None and row[3] == "met"
    assert row[2] == "3.10× (310.0 vs 100.0 tokens/s; TTFT p99 2,500 vs 9,000 ms)"
    gen["rows"]["continuous"] = _gen_row(250.0, 2500.0)
    assert generation_target(gen)[3] == "**not met**"  # type: ignore[index]
    assert generation_target(None) is None
    assert generation_target({"rows": {"continuous": {"status": "skipped"}}}) is None
