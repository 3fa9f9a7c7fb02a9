"""``fleet gpu-report`` end to end on this GPU-less machine: the real CLI, real models, Redis, workers.

On a CPU machine the report runs on the CPU chain and must still say, for each GPU provider, why it
does not load; every section must hold figures of this run (no empty cells where a figure belongs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _report(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "producer.cli", "gpu-report", "--quick", "--out", str(tmp_path / "r.md"),
         "--work-dir", str(tmp_path / "work"), *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    folder = tmp_path_factory.mktemp("gpu-report")
    done = _report(folder)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((folder / "r.json").read_text()), (folder / "r.md").read_text()


def test_every_provider_is_loaded_for_real_and_the_missing_ones_say_why(report: tuple[dict[str, Any], str]) -> None:
    results, markdown = report
    rows = {r["provider"]: r for r in results["providers"]}
    assert rows["CPUExecutionProvider"]["loads"] and rows["CPUExecutionProvider"]["reason"] is None
    for name in ("TensorrtExecutionProvider", "CUDAExecutionProvider"):
        assert not rows[name]["loads"]
        assert rows[name]["reason"].startswith(f"{name} is not in this onnxruntime build"), rows[name]
    assert results["provider"] == "cpu"
    assert "| CUDA | no | no | CUDAExecutionProvider is not in this onnxruntime build" in markdown


def test_placement_counts_every_node_of_each_served_graph(report: tuple[dict[str, Any], str]) -> None:
    import onnx

    results, _ = report
    models = {r["model"] for r in results["placement"]}
    assert models == {"fp32", "fp16", "int8-dynamic", "int8-static-qdq"}
    for row in results["placement"]:
        assert row["active"] == ["CPUExecutionProvider"]
        assert row["nodes"] == {"CPUExecutionProvider": row["total"]}
        # ONNX Runtime fuses nodes at load, so the count is of the optimized graph: at most the file's nodes
        graph_nodes = len(onnx.load(results["models"][row["model"]]["path"], load_external_data=False).graph.node)
        if row["model"] == "fp16":  # the CPU provider runs float16 nodes it has no float16 kernel for between Casts
            assert graph_nodes < row["total"] <= 2 * graph_nodes
            continue
        assert 0 < row["total"] <= graph_nodes + 2  # + the last-position gather of the served graph


def test_the_fleet_is_measured_against_the_ceiling_of_its_own_graph(report: tuple[dict[str, Any], str]) -> None:
    results, markdown = report
    plan = results["meta"]["plan"]
    for variant, entry in results["ceiling"].items():
        assert [p["batch_size"] for p in entry["points"]] == plan["batch_sizes"], variant
        assert all(p["qps"] > 0 and p["runs"] >= 3 for p in entry["points"])
    fleet = results["fleet"]
    assert set(fleet) == {"baseline", "batching", "int8", "fp16"}  # no TensorRT rows: it does not load here
    for key, row in fleet.items():
        assert row["per_request"]["errors"] == 0 and row["per_request"]["requests"] > 0, key
        assert row["providers_active"] == ["CPUExecutionProvider"]
    placement = {(r["model"], r["chain"]): r["nodes"] for r in results["placement"]}
    # each worker's own count at load (heartbeat) equals the report's profiled count of the same graph
    assert fleet["batching"]["nodes_at_load"] == placement[("fp32", "cpu")]
    assert fleet["int8"]["nodes_at_load"] == placement[("int8-dynamic", "cpu")]
    assert fleet["fp16"]["nodes_at_load"] == placement[("fp16", "cpu")]
    assert "Nodes per provider each worker counted at model load" in markdown
    assert fleet["batching"]["bulk"]["errors"] == 0 and fleet["batching"]["bulk"]["requests"] > 0
    shares = results["shares"]
    best_int8 = results["ceiling"]["int8-dynamic"]["best"]["qps"]
    assert shares["int8"]["per_request_of_best"] == pytest.approx(fleet["int8"]["per_request"]["qps"] / best_int8)
    assert shares["batching"]["bulk_of_best"] > 0
    assert "bulk path, 32 per message" in markdown and "| – |" not in markdown


def test_more_workers_of_one_model_are_loaded_by_several_client_processes(report: tuple[dict[str, Any], str]) -> None:
    results, markdown = report
    rows = results["scaling"]
    assert [r["workers"] for r in rows] == list(results["meta"]["plan"]["scale_workers"])
    for row in rows:
        assert row["errors"] == 0 and row["requests"] > 0 and row["qps"] > 0
        assert len(row["children"]) == results["meta"]["plan"]["scale_processes"]
        assert row["qps"] == pytest.approx(sum(c["qps"] for c in row["children"]))
    assert "## More workers on one device" in markdown


def test_generation_and_transfers_hold_figures_of_the_run(report: tuple[dict[str, Any], str]) -> None:
    results, markdown = report
    rows = results["generation"]["rows"]
    assert set(rows) == {"one_at_a_time", "static", "continuous"}
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in rows.values())
    t = results["transfers"]
    assert t["device"] == "cpu" and t["crossed"] is False
    rows_n, steps = results["meta"]["plan"]["transfer_rows"], results["meta"]["plan"]["transfer_steps"]
    # every row's first token at prefill, one per row per step, then one step with a row gone
    assert t["total"]["tokens"] == rows_n + rows_n * steps + (rows_n - 1)
    steady = t["phases"][f"{steps - 1} steady decode steps"]
    first = t["phases"]["first decode step (cache from numpy)"]
    assert steady["h2d_bytes"] / steady["tokens"] < first["h2d_bytes"] / first["tokens"]  # the cache stays put
    assert "nothing crossed a bus" in markdown
    fp16 = results["generation_fp16"]
    assert fp16["kv_in_place"] is True and fp16["model"].endswith("-fp16.onnx")
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in fp16["rows"].values())
    slots = results["transfers_in_place"]
    assert (slots["dtype"], slots["slots"], slots["device"]) == ("float16", "host", "cpu")
    assert slots["total"]["tokens"] == t["total"]["tokens"]
    left = slots["phases"]["step after one row leaves (no re-layout)"]
    after = t["phases"]["step after one row leaves (re-layout)"]
    assert left["h2d_bytes"] < after["h2d_bytes"] / 10  # the cache is not sent up again: ids, mask, positions only
    assert "### In-place cache (FP16 graph, float16 slots in host memory)" in markdown
    assert "### FP16 graph (" in markdown and "workers on the in-place cache)" in markdown


def test_decode_steps_as_graphs_say_why_they_did_not_run_and_the_rest_are_measured(
        report: tuple[dict[str, Any], str]) -> None:
    results, markdown = report
    g = results["decode_graphs"]
    assert g["providers"] == ["CPUExecutionProvider"] and g["same_tokens"] is True
    assert g["rounds"] == results["meta"]["plan"]["graph_rounds"]
    ordinary, fixed, graphs = (g["variants"][v] for v in ("ordinary steps", "fixed steps", "CUDA graphs"))
    assert ordinary["status"] == fixed["status"] == "ok" and ordinary["vs_ordinary"] == 1.0
    assert fixed["tokens_per_s"] > 0 and fixed["step_ms_p50"] > 0
    assert graphs == {"status": "not run", "reason": "the provider chain ['CPUExecutionProvider'] has no CUDA "
                                                     "provider (in this onnxruntime build)"}
    assert "## Decode steps as CUDA graphs (`engine.cuda_graph`)" in markdown
    assert "| CUDA graphs | not run: the provider chain" in markdown


def test_a_provider_that_cannot_run_here_is_refused_before_anything_is_built(tmp_path: Path) -> None:
    done = _report(tmp_path, "--provider", "cuda")
    assert done.returncode == 2
    assert "fleet gpu-report: --provider cuda cannot run on this machine: CUDAExecutionProvider is not in this " \
           "onnxruntime build" in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "work" / "models").exists()
