"""The one-Redis ceiling and the per-path summary of a dispatch run (bench.ceiling, pure)."""

from __future__ import annotations

import math
from typing import Any

from bench.ceiling import ceiling_rps, ceiling_section, celery_floor_note, floor_note, path_summary


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


def test_section_renders_the_paths_of_one_run_and_ignores_any_merged_runs() -> None:
    merged = path_summary(_dispatch(1.0, 77.0))
    text = ceiling_section({"dispatch": _dispatch(0.5, 20.0), "dispatch_runs": {"earlier": merged}})
    assert "| `fleet.infer` (FleetClient.submit + result) | 100 | 20.0 | 0.500 |" in text
    assert "**2,000**" in text
    assert "earlier" not in text and "77.0" not in text  # no run-to-run table: one run's figures only


def test_no_dispatch_run_renders_nothing() -> None:
    assert ceiling_section({}) == ""


def test_floor_note_splits_the_lean_commands_by_who_issues_them() -> None:
    # fleet.infer with every extra off, one request per take: the producer's script (evalsha + set NX, exists,
    # lpush), the worker's wait (blmove) and take script (evalsha + lrange, zadd, hset, exists, ltrim), the result
    # store's script (evalsha + set, publish, hdel, zrem), the waiter (subscribe, get, unsubscribe)
    calls = {"evalsha": 3, "set": 2, "exists": 2, "lpush": 1, "blmove": 1, "lrange": 1, "zadd": 1, "hset": 1,
             "ltrim": 1, "publish": 1, "hdel": 1, "zrem": 1, "subscribe": 1, "get": 1, "unsubscribe": 1, "llen": 0.5}
    lean = {"redis_calls": sum(calls.values()), "redis_cpu_ms": 0.4, "ceiling_rps": 2500.0, "total_cpu_ms": 5.0,
            "redis_calls_by_command": calls}  # fmt: skip
    note = floor_note(lean)
    assert "per-request acks (" in note and "the take script): 8.0;" in note  # lpush, blmove, lrange, ltrim, zadd,
    # hset, zrem, hdel
    assert "`unsubscribe`): 5.0;" in note  # the store's set + publish, subscribe, get, unsubscribe
    assert "admission's `llen`): 3.5;" in note  # the producer's set NX marker, 2 exists, llen
    assert "per stored state): 3.0." in note  # the three scripts' evalsha
    assert "other" not in note  # every command measured is attributed
    assert "other: 2.0" in floor_note({**lean, "redis_calls_by_command": {**calls, "client": 2}})


def _with_floor(floor_qps: float) -> dict[str, Any]:
    d = _dispatch(0.5, 20.0)
    d["floor"] = {"events": {**_loop(floor_qps, "producer", 3.0, 0.5, 3.5, 21.0), "lone_p50_ms": 5.5},
                  "lean": _loop(300, "producer", 2.0, 0.3, 2.0, 18.0)}  # fmt: skip
    return d


def test_the_stock_celery_floor_is_a_path_and_is_compared_with_the_fleet() -> None:
    summary = path_summary(_with_floor(90))
    assert list(summary["paths"])[-2:] == ["floor-events", "floor-lean"]
    assert summary["floor_lone_p50_ms"] == {"events": 5.5, "lean": None}
    note = celery_floor_note(summary)
    assert "ran 90 req/s" in note and "1.11× stock Celery's empty task" in note  # served 100 / 90
    assert "costs less than Celery's own empty task" not in note  # served CPU 7.5 ms > the floor's 7.0 ms
    assert "what the fleet adds on top of Celery's empty task" in note and "runs 300 req/s" in note
    cheaper = _with_floor(90)
    cheaper["floor"]["events"]["cpu_ms_per_request"]["worker"] = 9.0
    assert "costs less than Celery's own empty task" in celery_floor_note(path_summary(cheaper))
    assert celery_floor_note(path_summary(_dispatch(0.5, 20.0))) == ""  # no floor measured
