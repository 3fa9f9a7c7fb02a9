"""Pure parts of bench.multihost: the order of rounds, the table and its place in the docs."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.multihost import BEGIN, END, main, render_table, round_figures, round_order, splice


@pytest.mark.parametrize(("hosts", "passes", "expected"), [
    (3, 1, [1, 2, 3]),
    (3, 2, [1, 2, 3, 3, 2, 1]),
    (2, 3, [1, 2, 2, 1, 1, 2]),
    (1, 2, [1, 1]),
])
def test_round_order_goes_up_then_down(hosts: int, passes: int, expected: list[int]) -> None:
    assert round_order(hosts, passes) == expected


def _round(hosts: int, qps: float) -> dict[str, float]:
    return {"hosts": hosts, "qps": qps, "p50_ms": 10.0, "p99_ms": 30.0, "mean_batch": 2.0, "redis_core_pct": 12.0,
            "redis_cpu_ms_per_req": 0.6, "workers_cpu_ms_per_req": 4.0, "client_cpu_ms_per_req": 3.0,
            "machine_busy_pct": 95.0, "others_core_pct": 40.0, "errors": 0}


def test_table_gives_each_round_its_ratio_to_the_first_one_host_round() -> None:
    table = render_table({"rounds": [_round(1, 200.0), _round(2, 150.0), _round(1, 100.0)]})
    lines = table.splitlines()
    assert len(lines) == 2 + 3
    assert "| 1 | 1 | 200 | 1.00× |" in lines[2]
    assert "| 2 | 2 | 150 | 0.75× |" in lines[3]
    assert "| 3 | 1 | 100 | 0.50× |" in lines[4]


def test_splice_replaces_only_the_marked_block(tmp_path: Path) -> None:
    doc = tmp_path / "scale.md"
    doc.write_text(f"# Scale\n\nbefore\n{BEGIN}\nold table\n{END}\nafter\n")
    splice(doc, "| new |", "python -m bench.multihost")
    text = doc.read_text()
    assert "old table" not in text and "| new |" in text
    assert text.startswith("# Scale\n\nbefore\n") and text.endswith(f"{END}\nafter\n")


def test_splice_refuses_a_file_without_markers(tmp_path: Path) -> None:
    doc = tmp_path / "scale.md"
    doc.write_text("# Scale\n")
    with pytest.raises(ValueError, match="multihost:begin"):
        splice(doc, "| new |", "cmd")


def test_round_figures_price_each_group_per_request_and_leave_the_rest_to_others() -> None:
    res = {"wall_s": 10.0, "requests": 1000, "cpu_s": {"machine_busy": 18.0, "machine_idle": 2.0, "redis": 1.0,
                                                       "workers": 6.0, "self": 4.0}}
    f = round_figures(res, cpus=2)
    assert f["machine_busy_pct"] == pytest.approx(90.0)
    assert f["redis_core_pct"] == pytest.approx(10.0) and f["redis_cpu_ms_per_req"] == pytest.approx(1.0)
    assert f["workers_cpu_ms_per_req"] == pytest.approx(6.0) and f["client_cpu_ms_per_req"] == pytest.approx(4.0)
    assert f["others_core_pct"] == pytest.approx(180.0 - 110.0)  # 1.8 cores busy, the fleet used 1.1


@pytest.mark.parametrize(("argv", "says"), [
    (["--passes", "0"], "--passes"),
    (["--duration", "900"], "outside 0..600"),
    (["--duration", "5", "--warmup", "5"], "--warmup 5 must be below --duration 5"),
])
def test_bad_options_are_refused_naming_the_option(argv: list[str], says: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(argv)
    assert says in capsys.readouterr().err
