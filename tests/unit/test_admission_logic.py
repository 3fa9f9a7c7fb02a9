"""Admission arithmetic with an injected clock: token bucket, drain rate, Retry-After, parsing."""

from __future__ import annotations

import base64
import json

import pytest

from producer.admission import (
    bucket_take,
    drain_rate_per_s,
    queue_retry_after_s,
    rate_key_for,
    rate_retry_after_s,
)
from producer.registry import FleetState, ModelState, message_submitted_at, readiness_problems
from protocol.errors import QueueFull, RateLimited, error_from_payload


def _run(events: list[tuple[float, float]], capacity: float, refill: float) -> list[bool]:
    tokens = ts = None
    out = []
    for now, cost in events:
        d = bucket_take(tokens, ts, now, capacity=capacity, refill_per_s=refill, cost=cost)
        tokens, ts = d.tokens, d.ts_s
        out.append(d.allowed)
    return out


@pytest.mark.parametrize(
    ("events", "capacity", "refill", "expected"),
    [
        # a new bucket starts full: capacity requests pass at once, the next is refused
        ([(0, 1)] * 4, 3, 1, [True, True, True, False]),
        # refill of 2/s: after 0.5 s exactly one token is back
        ([(0, 1), (0, 1), (0.5, 1), (0.5, 1)], 2, 2, [True, True, True, False]),
        # refill never overfills: 100 s idle still leaves only `capacity`
        ([(0, 2), (100, 1), (100, 1), (100, 1)], 2, 5, [True, True, True, False]),
        # a cost larger than what is left is refused and spends nothing
        ([(0, 2), (0, 2), (0, 1)], 3, 0, [True, False, True]),
        # a clock that goes backwards refills nothing
        ([(10, 1), (5, 1), (10, 1)], 1, 1, [True, False, False]),
        # no refill: a fixed quota
        ([(t, 1) for t in range(5)], 2, 0, [True, True, False, False, False]),
    ],
)
def test_bucket_table(events: list[tuple[float, float]], capacity: float, refill: float, expected: list[bool]) -> None:
    assert _run(events, capacity, refill) == expected


def test_bucket_admits_capacity_plus_refill_over_a_span() -> None:
    # one request every 1/16 s for 3 s against capacity 10, refill 4/s: 10 + 4 * 3 = 22 admitted
    events = [(i / 16, 1.0) for i in range(3 * 16 + 1)]
    assert sum(_run(events, 10, 4)) == 22
    # at an irregular pace, float rounding may cost a fraction of a token, never more than one
    jittery = [(i * 0.01, 1.0) for i in range(301)]
    assert 21 <= sum(_run(jittery, 10, 4)) <= 22


@pytest.mark.parametrize(
    ("tokens", "cost", "refill", "max_s", "expected"),
    [
        (0.0, 1, 1.0, 60, 1),
        (0.5, 1, 0.25, 60, 2),  # 0.5 token missing at 0.25/s
        (0.0, 10, 0.5, 60, 20),
        (0.0, 10, 0.1, 60, 60),  # clamped to max
        (0.0, 1, 0.0, 30, 30),  # never refills: the cap
        (0.99, 1, 100.0, 60, 1),  # never below 1 s
    ],
)
def test_rate_retry_after(tokens: float, cost: float, refill: float, max_s: int, expected: int) -> None:
    assert rate_retry_after_s(tokens, cost, refill, max_s) == expected


@pytest.mark.parametrize(
    ("counts", "now_s", "window_s", "expected"),
    [
        ({}, 1000.5, 30, 0.0),
        ({1000: 10}, 1000.5, 30, 10.0),  # the current second counts as a full one
        ({991: 10, 1000: 10}, 1000.9, 30, 2.0),  # 20 requests over the 10 s since activity began
        ({900: 50, 995: 12}, 1000.0, 30, 2.0),  # 900 is outside the window
        ({999: 0, 1000: 4}, 1000.0, 30, 4.0),  # zero buckets do not stretch the span
        ({1001: 9}, 1000.0, 30, 0.0),  # a future second (skewed clock) is ignored
    ],
)
def test_drain_rate(counts: dict[int, int], now_s: float, window_s: float, expected: float) -> None:
    assert drain_rate_per_s(counts, now_s, window_s) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("depth", "cap", "count", "rate", "max_s", "expected"),
    [
        (10, 10, 1, 2.0, 60, 1),  # one must leave: 0.5 s, rounded up to 1
        (10, 10, 1, 0.1, 60, 10),
        (12, 10, 1, 1.0, 60, 3),  # overshoot by concurrent submitters: 3 must leave
        (10, 10, 5, 1.0, 60, 5),  # a batch of 5 needs 5 free slots
        (10, 10, 1, 0.0, 45, 45),  # nobody drains: the cap
        (10, 10, 1, 0.001, 45, 45),
        (3, 10, 1, 0.0, 45, 1),  # not full at all
    ],
)
def test_queue_retry_after(depth: int, cap: int, count: int, rate: float, max_s: int, expected: int) -> None:
    assert queue_retry_after_s(depth, cap, count, rate, max_s) == expected


def test_rate_key_hides_the_api_key() -> None:
    key = rate_key_for("s3cret-key")
    assert "s3cret" not in key and len(key) == 24 and key == rate_key_for("s3cret-key")
    assert rate_key_for(None) == rate_key_for("") == "anonymous"
    assert rate_key_for("a") != rate_key_for("b")


def test_admission_errors_survive_celery_style_rebuild() -> None:
    exc = QueueFull("queue full", "max_queue_depth", 5, 7.0)
    assert exc.retry_after_s == 7.0 and exc.to_payload()["limit"] == 5
    rebuilt = error_from_payload("RateLimited", list(RateLimited("slow down", "rate_capacity", 3, 2.0).args))
    assert isinstance(rebuilt, RateLimited) and rebuilt.field == "rate_capacity"


def _kombu_message(request: dict[str, object]) -> bytes:
    body = base64.b64encode(json.dumps([[request], {}, {}]).encode()).decode()
    envelope = {
        "body": body,
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": {"task": "fleet.infer"},
        "properties": {"body_encoding": "base64"},
    }
    return json.dumps(envelope).encode()


def test_message_submitted_at() -> None:
    assert message_submitted_at(_kombu_message({"model": "m", "submitted_at_unix_s": 123.5})) == 123.5
    assert message_submitted_at(_kombu_message({"model": "m"})) is None
    assert message_submitted_at(b"not json") is None
    assert message_submitted_at(json.dumps({"body": "%%%", "properties": {"body_encoding": "base64"}})) is None


def _model(name: str, workers: list[dict[str, object]]) -> ModelState:
    return ModelState(name, f"fleet.{name}", 0, 10, None, 0.0, workers, None)


def test_readiness_problems() -> None:
    ready = {"hostname": "a", "ready": True, "version": "1.0.0", "in_flight": 2}
    warming = {"hostname": "b", "ready": False, "version": "1.0.0", "in_flight": 0}
    state = FleetState(None, [_model("lm", [ready, warming]), _model("enc", [warming]), _model("x", [])])
    assert readiness_problems(state) == ["model 'enc' has no ready worker (1 starting)", "model 'x' has no worker"]
    assert readiness_problems(state, ["lm"]) == []
    assert readiness_problems(state, ["nope"]) == ["model 'nope' is not configured"]
    assert readiness_problems(FleetState("Redis down")) == ["Redis down"]
    assert state.models[0].ready_workers == 1 and state.models[0].in_flight == 2
    assert state.models[0].versions == ["1.0.0"]
