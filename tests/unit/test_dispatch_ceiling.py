"""The one-Redis ceiling and the per-path summary of a dispatch run (bench.ceiling, pure)."""

from __future__ import annotations

import math
from typing import Any

from bench.ceiling import ceiling_rps, ceiling_section, celery_floor_note, floor_note, path_summary, targets_table


def _loop(qps: float, front: str, front_ms: float, redis_ms: float, worker_ms: float, calls: float) -> dict[str, Any]:
    return {
        "summary": {"qps": qps},
        "cpu_ms_per_request": {front: front_ms, "redis": redis_ms, "worker": worker_ms},
        "redis_calls_per_request": {"lpush": 1.0, "get": calls - 1.0},
        "redis_calls_total_per_request": calls,
    }


def _dispatch(redis_ms: float, calls: float) -> dict[str, Any]:
    return {
        "loop": _loop(100, "producer", 3.0, redis_ms, 4.0, calls),
        "lone": {"latency": {"p50_ms": 9.0}},
        "ablations": {"bulk": {"loop": _loop(500, "producer", 0.5, 0.1, 1.0, 5.0)}, "info": {"loop": {}}},
        "gateway": {**_loop(60, "gateway", 9.0, 1.0, 6.0, 40.0), "polls_per_request": 2.5},
        "meta": {"commit": "abcdef0123", "dirty": False},
    }


def test_ceiling_is_one_redis_core_over_redis_cpu_per_request() -> None:
    assert ceiling_rps(0.8) == 1250.0
    assert math.isnan(ceiling_rps(0.0))


def test_summary_has_each_path_with_totals_and_ceiling() -> None:
    s = path_summary(_dispatch(0.5, 30.0))
    assert list(s["paths"]) == ["served", "bulk", "gateway"]  # unknown variants ("info") left out
    served = s["paths"]["served"]
    assert served["total_cpu_ms"] == 7.5 and served["ceiling_rps"] == 2000 and served["redis_calls"] == 30.0
    assert s["paths"]["gateway"]["front_cpu_ms"] == 9.0 and s["paths"]["gateway"]["ceiling_rps"] == 1000
    assert s["commit"] == "abcdef0123" and s["lone_p50_ms"] == 9.0


def test_section_renders_paths_and_before_after_ratios() -> None:
    before, after = path_summary(_dispatch(1.0, 40.0)), path_summary(_dispatch(0.5, 20.0))
    text = ceiling_section({"dispatch": _dispatch(0.5, 20.0), "dispatch_runs": {"before": before, "after": after}})
    assert "| `fleet.infer` (FleetClient.submit + result) | 100 | 20.0 | 0.500 |" in text
    assert "**2,000**" in text
    after_row = next(line for line in text.splitlines() if line.startswith("| after (abcdef0") and "submit +" in line)
    assert after_row.endswith("| 1.00× | 0.50× | 0.94× |")  # req/s, commands, CPU against the first run


def test_no_dispatch_run_renders_nothing() -> None:
    assert ceiling_section({}) == ""


def test_targets_compare_the_last_run_with_the_first() -> None:
    before, after = path_summary(_dispatch(1.0, 40.0)), path_summary(_dispatch(0.5, 20.0))
    after["lone_over_bare_ms"] = 4.0
    rows = targets_table({"before": before, "after": after}).splitlines()
    assert rows[2].startswith("| Redis commands per request ≤ 0.5× | 40.0 → 20.0 | 0.50× | met |")
    assert rows[3].endswith("| 0.94× | **not met** |")  # CPU 8.0 → 7.5
    assert rows[4].endswith("| **not met** |") and rows[5].endswith("| met |")  # same req/s; 4 ms over bare
    assert targets_table({"before": before}) == ""  # nothing to compare with


def test_targets_prefer_the_old_path_of_the_same_run() -> None:
    run = path_summary(_dispatch(0.5, 20.0))
    run["paths"]["legacy"] = {**run["paths"]["served"], "redis_calls": 50.0, "qps": 40.0}
    table = targets_table({"after": run})
    assert "vs the old path, same run" in table
    assert "| 50.0 → 20.0 | 0.40× | met |" in table and "| 40 → 100 | 2.50× | met |" in table


def test_floor_note_splits_the_lean_commands_by_who_issues_them() -> None:
    lean = {
        "redis_calls": 21.0, "redis_cpu_ms": 0.4, "ceiling_rps": 2500.0, "total_cpu_ms": 5.0,
        "redis_calls_by_command": {"lpush": 1, "brpop": 1, "zadd": 1, "hset": 1, "zrem": 1, "hdel": 1, "multi": 3,
                                   "exec": 3, "get": 2, "setex": 1, "publish": 1, "subscribe": 1, "unsubscribe": 1,
                                   "set": 1, "exists": 1, "incrby": 1, "expire": 1},
    }  # fmt: skip
    note = floor_note(lean)
    assert "per-request acks (" in note and "): 10.0;" in note  # 6 commands + 2 multi/exec pairs
    assert "`unsubscribe`): 8.0;" in note  # 6 + 1 multi/exec pair
    assert "admission's `llen`): 4.0." in note


def _with_floor(floor_qps: float) -> dict[str, Any]:
    d = _dispatch(0.5, 20.0)
    d["ablations"]["legacy"] = {"loop": _loop(80, "producer", 5.0, 0.8, 6.0, 35.0)}
    d["floor"] = {"events": {**_loop(floor_qps, "producer", 3.0, 0.5, 3.5, 21.0), "lone_p50_ms": 5.5},
                  "lean": _loop(300, "producer", 2.0, 0.3, 2.0, 18.0)}  # fmt: skip
    return d


def test_the_stock_celery_floor_is_a_path_and_says_whether_it_stops_the_2x_target() -> None:
    summary = path_summary(_with_floor(120))
    assert list(summary["paths"])[-2:] == ["floor-events", "floor-lean"]
    assert summary["floor_lone_p50_ms"] == {"events": 5.5, "lean": None}
    note = celery_floor_note({"after": summary})
    assert "ran 120 req/s" in note and "0.83× stock Celery's empty task" in note  # served 100 / 120
    assert "The 2× target (160 req/s) is 1.33× what stock Celery does with no work at all" in note
    assert "Celery itself" in note and "runs 300 req/s (3.75× the old path)" in note
    clears = celery_floor_note({"after": path_summary(_with_floor(170))})
    assert "Celery alone does not stop it" in clears and "Celery itself" not in clears
    assert celery_floor_note({"after": path_summary(_dispatch(0.5, 20.0))}) == ""  # no floor measured
    rows = targets_table({"after": summary})
    assert "for scale: stock Celery, empty task, task + sent events" in rows


def test_repeated_runs_show_their_ratios_side_by_side() -> None:
    from bench.ceiling import repeat_table

    runs = {"r1": path_summary(_with_floor(120)), "r2": path_summary(_with_floor(170))}
    rows = repeat_table(runs).splitlines()
    assert rows[2].startswith("| r1 | 100 / 80 | 1.25× |") and "| 1.50× |" in rows[2]  # floor 120 / old 80
    assert rows[3].startswith("| r2 |") and "| 2.12× |" in rows[3]
    assert repeat_table({"r1": runs["r1"]}) == ""  # one run: nothing to compare


def test_floor_note_gives_the_store_script_its_set_and_the_producer_its_marker() -> None:
    lean = {
        "redis_calls": 14.2, "redis_cpu_ms": 0.3, "ceiling_rps": 3000.0, "total_cpu_ms": 4.0,
        "redis_calls_by_command": {"lpush": 1, "brpop": 1, "zadd": 1, "hset": 1, "exists": 1, "evalsha": 1, "set": 2,
                                   "publish": 1, "hdel": 1, "zrem": 1, "get": 1, "subscribe": 1, "unsubscribe": 1,
                                   "llen": 0.2},
    }  # fmt: skip
    note = floor_note(lean)
    assert "on the old path)" in note and "): 6.0;" in note  # kombu: 6, no transactions
    assert "`unsubscribe`): 6.0;" in note  # evalsha, its set and publish, the waiter's three
    assert "admission's `llen`): 2.2." in note  # the marker, the cancel mark, a fifth of an LLEN


def test_floor_note_counts_the_rpop_of_a_batched_take_with_kombu_s_delivery() -> None:
    lean = {
        "redis_calls": 12.0, "redis_cpu_ms": 0.2, "ceiling_rps": 5000.0, "total_cpu_ms": 2.5,
        "redis_calls_by_command": {"lpush": 1, "brpop": 0.25, "rpop": 0.25, "zadd": 1, "hset": 1, "exists": 1,
                                   "evalsha": 1, "set": 2, "publish": 1, "hdel": 1, "zrem": 1},
    }  # fmt: skip
    note = floor_note(lean)
    assert "`rpop` of several more" in note and "): 5.5;" in note  # one BRPOP and one RPOP per 4 messages
