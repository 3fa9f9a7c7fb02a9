"""``fleet bench --quick`` end to end: the harness runs every phase on the real path and writes its report,
a tiny generation row (one at a time, static, continuous, the in-process limit) on the demo LM included.

A smoke run, not a speed test: it checks that every row was measured (or says why not), that the
numbers are well formed, and that the Markdown, the JSON and the plots exist. Never asserts speed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.ceiling import path_summary

pytestmark = pytest.mark.slow


@pytest.mark.timeout(420)
def test_quick_bench_end_to_end(tmp_path: Path) -> None:
    out_md, img, raw = tmp_path / "benchmarks.md", tmp_path / "img", tmp_path / "benchmarks.json"
    cmd = [
        sys.executable, "-m", "producer.cli", "bench", "--quick", "--out", str(out_md), "--img-dir", str(img),
        "--json", str(raw), "--work-dir", str(tmp_path / "work"),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "peer: skipped (--quick)" in done.stderr

    results = json.loads(raw.read_text())
    assert results["meta"]["quick"] is True
    rows = results["rows"]
    for key in ("baseline", "batching", "int8"):
        assert rows[key]["status"] == "ok", key
        assert rows[key]["peak_rss_bytes"] > 0 and rows[key]["model_bytes"] > 0
        assert rows[key]["providers_requested"] == rows[key]["providers_active"] == ["CPUExecutionProvider"]
        for wl in ("long", "short"):
            entry = rows[key]["workloads"][wl]
            for summary in (entry["lone"], entry["saturation"], *[p["summary"] for p in entry["open"]]):
                assert summary["requests"] > 0 and summary["errors"] == 0, (key, wl)
                lat = summary["latency"]
                assert 0 < lat["p50_ms"] <= lat["p95_ms"] <= lat["p99_ms"] <= lat["max_ms"]
                assert summary["mean_batch_size"] >= 1 and 0 < summary["padding_efficiency"] <= 1
    assert rows["baseline"]["workloads"]["long"]["saturation"]["mean_batch_size"] == 1.0
    assert rows["peer"]["status"] == "skipped (--quick)"
    # the phases with their own tiers say so (tests/genai and tests/guidellm run them)
    assert results["same_weights"] == results["guidellm"] == {"status": "skipped (--quick)"}
    # the real reason on this machine (the CPU build has no TensorRT EP), not "needs a GPU"
    assert rows["tensorrt"]["status"] == "ok" or rows["tensorrt"]["status"].startswith(
        "not run: TensorrtExecutionProvider is not in this onnxruntime build (onnxruntime ")
    for variant in ("fp32", "int8"):
        for wl in ("long", "short"):
            assert results["limit"][variant][wl]["best"]["qps"] > 0
            assert results["limit"][variant][wl]["providers_active"] == ["CPUExecutionProvider"]
    dispatch = results["dispatch"]["loop"]
    assert dispatch["summary"]["qps"] > 0 and dispatch["summary"]["errors"] == 0
    assert set(dispatch["cpu_ms_per_request"]) == {"producer", "redis", "worker"}
    assert dispatch["redis_calls_per_request"]["lpush"] >= 1  # one message per request
    assert results["models"]["variants"]["dynamic"]["written"] is True

    gen = results["generation"]
    assert gen["providers"] == {"requested": ["CPUExecutionProvider"], "active": ["CPUExecutionProvider"]}
    total = gen["workload"]["output_tokens_total"]
    for key in ("one_at_a_time", "static", "continuous"):
        row = gen["rows"][key]
        assert row["status"] == "ok", key
        for summary in (row["saturation"], *[p["summary"] for p in row["open"]]):
            assert summary["requests"] > 0 and summary["errors"] == 0 and summary["tokens_per_s"] > 0, key
            assert 0 < summary["ttft"]["p50_ms"] <= summary["ttft"]["p99_ms"] <= summary["latency"]["max_ms"]
        assert row["saturation"]["tokens"] == total * gen["plan"]["rounds"]  # ignore_eos: exactly max_new_tokens
        assert row["saturation"]["worker"]["tokens"] == row["saturation"]["tokens"]  # the worker's own count
    assert gen["rows"]["one_at_a_time"]["saturation"]["mean_batch"] == 1.0
    assert gen["limit"]["best"]["tokens_per_s"] > 0 and gen["limit"]["relayout"]["relayout_ms"] > 0
    assert all(run["tokens"] == total for run in gen["limit"]["loop"].values())
    assert 0 < gen["limit"]["profile"]["concat_share"] < 1
    assert gen["meta"]["command"].startswith("fleet bench --quick") and gen["meta"]["commit"]

    md = out_md.read_text()
    commit = results["meta"]["machine"]["git_commit"]
    assert f"at commit `{commit}`" in md  # the one run's commit, stated at the top
    assert ("**Warning: not a committed state.**" in md) == results["meta"]["machine"]["git_dirty"]
    assert "Warning: not one run" not in md  # every phase measured together
    for text in (
        "baseline (FP32, max_batch_size 1)", "+ dynamic batching", "+ INT8 (dynamic)", "+ TensorRT EP FP16",
        "limit: bare session.run", "peer: celery-batches", "skipped (--quick)", "## Dispatch cost", "## Targets",
        "fleet bench --quick", "## Generation — continuous batching", "continuous batching ≥ 3× one-at-a-time",
        "in process: continuous generation loop", "limit: bare decode loop",
        "## Same weights: the fleet, a bare loop and onnxruntime-genai\n\nskipped (--quick).",
        "## guidellm against the gateway\n\nskipped (--quick).",
    ):  # fmt: skip
        assert text in md, text
    if rows["tensorrt"]["status"] != "ok":
        assert "not run: TensorrtExecutionProvider is not in this onnxruntime build" in md
    for name in ("latency-vs-qps-long", "latency-vs-qps-short", "generation-vs-load"):
        assert (img / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"img/{name}.png" in md


@pytest.mark.timeout(240)
def test_quick_dispatch_phase_alone_measures_each_path(tmp_path: Path) -> None:
    out_md, raw = tmp_path / "dispatch.md", tmp_path / "dispatch.json"
    cmd = [
        sys.executable, "-m", "producer.cli", "bench", "--quick", "--only", "dispatch",
        "--out", str(out_md), "--json", str(raw), "--work-dir", str(tmp_path / "work"),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=220, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(raw.read_text())
    assert "dispatch_runs" not in results and "label" not in results["dispatch"]["meta"]  # one run, no run names
    run = path_summary(results["dispatch"])
    assert set(run["paths"]) == {"served", "bulk", "gateway", "gateway-wait", "floor-events", "floor-lean"}
    for name, path in run["paths"].items():
        assert path["qps"] > 0 and path["redis_cpu_ms"] > 0 and path["ceiling_rps"] > 0, name
        assert path["redis_calls_by_command"]["lpush"] > 0 and path["total_cpu_ms"] > path["redis_cpu_ms"], name
    assert results["dispatch"]["gateway"]["errors"] == 0 and results["dispatch"]["gateway_wait"]["errors"] == 0
    assert results["dispatch"]["gateway_wait"]["polls_per_request"] == 1.0  # one GET, answered with the result
    lone = results["dispatch"]["lone_profile"]
    for mode in ("pubsub", "poll"):
        assert lone[mode]["total"] > lone[mode]["engine"] > 0, mode
    assert results["dispatch"]["floor"]["events"]["channel"] == "kombu.transport.redis.Channel"  # stock, not ours
    text = out_md.read_text()
    assert "one-Redis ceiling" in text and "Where a lone request's time goes" in text


@pytest.mark.timeout(240)
def test_quick_multiturn_phase_runs_every_row_on_the_same_conversations(tmp_path: Path) -> None:
    out_md = tmp_path / "benchmarks.md"
    cmd = [sys.executable, "-m", "producer.cli", "bench", "--quick", "--only", "multiturn", "--out", str(out_md),
           "--work-dir", str(tmp_path / "work")]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=220, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads((tmp_path / "multiturn.json").read_text())
    rows = results["rows"]
    assert list(rows) == ["no_reuse", "reuse", "reuse_routing"]
    assert results["same_replies"] is True  # greedy replies identical with reuse and routing on and off
    plan = results["plan"]
    for key, row in rows.items():
        assert row["turns"] == plan["conversations"] * plan["turns"], key
    assert rows["no_reuse"]["hit_rate"] == 0 and rows["no_reuse"]["routed"] == 0
    assert rows["reuse"]["routed"] == 0
    # every conversation's later turns went to the worker holding it (quick prompts span >= 1 block)
    assert rows["reuse_routing"]["routed"] > 0 and rows["reuse_routing"]["hit_rate"] > 0
    assert "reuse + routing" in (tmp_path / "multiturn.md").read_text()


@pytest.mark.timeout(240)
def test_quick_gateway_phase_measures_every_route_against_the_client(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "producer.cli", "bench", "--quick", "--only", "gateway", "--out",
           str(tmp_path / "benchmarks.md"), "--work-dir", str(tmp_path / "work")]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=220, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads((tmp_path / "gateway.json").read_text())
    rows = {kind: setup["rows"] for kind, setup in results["setups"].items()}
    assert list(rows["lm"]) == ["client", "native_poll", "native_wait", "submit_wait"]
    assert list(rows["encoder"]) == ["client", "embeddings"]
    for kind, setup_rows in rows.items():
        for key, row in setup_rows.items():
            assert row["errors"] == 0 and row["qps"] > 0 and row["lone_p50_ms"] > 0, (kind, key, row)
            assert row["cpu_ms_per_request"]["worker"] > 0 and row["cpu_ms_per_request"]["callers"] > 0
            if key != "client":
                assert row["ratio"] > 0 and row["cpu_ms_per_request"]["gateway"] > 0
    assert "× FleetClient" in (tmp_path / "gateway.md").read_text()
