"""planner.trace (files and generators), planner.service loading and the ``fleet plan`` command on a tiny grid."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from planner.service import load_service_times
from planner.trace import Burst, TraceError, diurnal, load_trace, parse_burst, poisson
from producer.cli import main as fleet_main


def test_csv_and_jsonl_traces_load_sorted(tmp_path: Path) -> None:
    (tmp_path / "t.csv").write_text("arrival_s,prompt_tokens\n2.5,10\n0.5,3\n")
    (tmp_path / "t.jsonl").write_text('{"arrival_s": 2.5}\n\n{"arrival_s": 0.5}\n')
    csv_trace, jsonl_trace = load_trace(tmp_path / "t.csv"), load_trace(tmp_path / "t.jsonl")
    assert csv_trace.arrival_s.tolist() == [0.5, 2.5] and csv_trace.prompt_tokens is not None
    assert csv_trace.prompt_tokens.tolist() == [3, 10]
    assert jsonl_trace.arrival_s.tolist() == [0.5, 2.5] and jsonl_trace.prompt_tokens is None


@pytest.mark.parametrize(("name", "text", "match"), [
    ("a.csv", "arrival_s\n-1\n", r"a.csv:2: field 'arrival_s' must be finite and >= 0"),
    ("b.csv", "when\n1\n", r"b.csv:2: field 'arrival_s' is missing"),
    ("c.jsonl", '{"arrival_s": "soon"}\n', r"c.jsonl:1: field 'arrival_s' must be a number"),
    ("d.jsonl", '{"arrival_s": 1, "prompt_tokens": 0}\n', r"field 'prompt_tokens' must be >= 1"),
    ("e.txt", "1\n", r"trace files are .csv or .jsonl"),
    ("f.csv", "arrival_s\n", r"no requests"),
])
def test_bad_trace_files_name_the_field_and_the_limit(tmp_path: Path, name: str, text: str, match: str) -> None:
    (tmp_path / name).write_text(text)
    with pytest.raises(TraceError, match=match):
        load_trace(tmp_path / name)


def test_poisson_rate_and_burst_are_what_was_asked() -> None:
    trace = poisson(50.0, 200.0, bursts=(Burst(100.0, 20.0, 4.0),), seed=1)
    in_burst = np.count_nonzero((trace.arrival_s >= 100) & (trace.arrival_s < 120))
    outside = len(trace) - in_burst
    assert outside / 180.0 == pytest.approx(50.0, rel=0.05)
    assert in_burst / 20.0 == pytest.approx(200.0, rel=0.08)


def test_diurnal_peaks_midway_at_the_peak_rate() -> None:
    trace = diurnal(1.0, 40.0, seed=2)
    _, rate = trace.rate_per_s(360.0)
    assert rate[len(rate) // 2 - 1 : len(rate) // 2 + 1].mean() == pytest.approx(39.0, rel=0.1)
    assert rate[0] < 10.0 and rate[-1] < 10.0


@pytest.mark.parametrize(("text", "match"), [("1:2", "three numbers"), ("1:0:2", "duration_s"), ("a:b:c", "three")])
def test_bad_bursts_are_refused(text: str, match: str) -> None:
    with pytest.raises(TraceError, match=match):
        parse_burst(text)


def test_service_times_from_the_bench_report_and_from_a_plain_file(tmp_path: Path) -> None:
    bench = {"limit": {"fp32": {"short": {"points": [{"batch_size": 1, "batch_ms": 14.0},
                                                     {"batch_size": 8, "batch_ms": 66.0}]}}}}
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    (tmp_path / "plain.json").write_text('{"batch_ms": {"1": 2.0, "4": 5.0}}')
    assert load_service_times(tmp_path / "bench.json", "fp32/short").points == ((1, 14.0), (8, 66.0))
    assert load_service_times(tmp_path / "plain.json").batch_ms(4) == 5.0
    with pytest.raises(ValueError, match=r"no series 'int8/long' under 'limit' \(have \['fp32/short'\]\)"):
        load_service_times(tmp_path / "bench.json", "int8/long")


def test_fleet_plan_writes_the_table_json_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "svc.json").write_text('{"batch_ms": {"1": 10.0, "8": 40.0}}')
    argv = ["plan", "--poisson-rps", "30", "--duration-s", "120", "--burst", "60:10:5", "--service",
            str(tmp_path / "svc.json"), "--list-length", "4,8", "--polling-interval", "5", "--min-replicas", "1",
            "--start-s", "10", "--quiet", "--out-dir", str(tmp_path / "out")]
    assert fleet_main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["settings"] == 2 and summary["chosen"] is not None
    doc = json.loads((tmp_path / "out" / "plan-grid.json").read_text())
    assert [r["list_length"] for r in doc["rows"]] == [4, 8]
    assert "| listLength |" in (tmp_path / "out" / "plan-grid.md").read_text()
    for png in ("plan-grid.png", "plan-timeline.png"):
        assert (tmp_path / "out" / "img" / png).read_bytes()[:4] == b"\x89PNG"


def test_fleet_plan_refuses_a_bad_grid_value(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = fleet_main(["plan", "--poisson-rps", "1", "--duration-s", "5", "--list-length", "four", "--quiet",
                       "--out-dir", str(tmp_path)])
    error = json.loads(capsys.readouterr().out)
    assert code == 2 and error["field"] == "--list-length" and "comma-separated numbers" in error["message"]
