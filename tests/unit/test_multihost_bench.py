"""Pure parts of bench.multihost: the order of rounds, the table and its place in the docs."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.multihost import BEGIN, END, render_table, round_order, splice


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
