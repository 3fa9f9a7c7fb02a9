"""Pure parts of the model lifecycle: sticky routing and its split, the canary verdict."""

from __future__ import annotations

import pytest

from protocol.canary_verdict import (
    Outcome,
    canary_verdict,
    percentile,
    supported_percentile,
    unserved_canary_verdict,
    version_figures,
)
from protocol.model_state import ModelState, route, routing_fraction, samples_prompt
from protocol.settings import CanarySettings


def _state(weight: int, canary: str | None = "2") -> ModelState:
    return ModelState(model="m", stable="1", canary=canary, canary_weight=weight)


def test_routing_fraction_is_fixed_and_in_unit_interval() -> None:
    keys = [f"key-{i}" for i in range(1000)]
    fractions = [routing_fraction(k) for k in keys]
    assert fractions == [routing_fraction(k) for k in keys]
    assert all(0 <= f < 1 for f in fractions)
    assert len(set(fractions)) == len(fractions)


@pytest.mark.parametrize("weight", [1, 10, 50, 90])
def test_route_split_follows_weight(weight: int) -> None:
    n = 20_000
    canary = sum(route(_state(weight), f"req-{i}") == "canary" for i in range(n))
    assert abs(canary / n - weight / 100) < 0.01


def test_route_is_sticky_and_monotonic_in_weight() -> None:
    # a key on the canary at weight w stays there at any larger weight (raising the share moves only new keys)
    keys = [f"session-{i}" for i in range(2000)]
    at_10 = {k for k in keys if route(_state(10), k) == "canary"}
    at_30 = {k for k in keys if route(_state(30), k) == "canary"}
    assert at_10 < at_30
    assert all(route(_state(10), k) == "canary" for k in at_10)


@pytest.mark.parametrize("state", [None, _state(10, canary=None), _state(0)])
def test_route_without_canary_is_stable(state: ModelState | None) -> None:
    assert {route(state, f"k{i}") for i in range(500)} == {"stable"}


def test_percentile_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def _samples(version: str, role: str, n: int, errors: int = 0, latency_ms: float = 10.0) -> list[Outcome]:
    return [
        Outcome(version, "canary" if role == "canary" else "stable", i >= errors, latency_ms, 1000.0 + i)
        for i in range(n)
    ]


def test_version_figures_group_by_version_not_role() -> None:
    samples = [*_samples("1", "stable", 10), *_samples("1", "canary", 5, errors=1), *_samples("2", "canary", 4)]
    figs = version_figures(samples)
    assert figs["1"].requests == 15 and figs["1"].errors == 1
    assert figs["2"].requests == 4 and figs["2"].error_rate == 0


BOUNDS = CanarySettings(min_requests=20, max_error_rate=0.05, max_p99_ms=None, max_p99_ratio=3.0)


@pytest.mark.parametrize(
    ("canary_n", "canary_errors", "canary_ms", "stable_n", "bounds", "rollback", "reason_part"),
    [
        (19, 19, 10.0, 100, BOUNDS, False, None),  # below min_requests: no verdict however bad
        (20, 1, 10.0, 100, BOUNDS, False, None),  # 5 % is not above 5 %
        (20, 2, 10.0, 100, BOUNDS, True, "error rate 0.100"),
        (40, 0, 31.0, 100, BOUNDS, True, "max_p99_ratio 3.0"),
        (40, 0, 29.0, 100, BOUNDS, False, None),
        (40, 0, 31.0, 10, BOUNDS, False, None),  # ratio needs min_requests of stable too
        (40, 0, 31.0, 0, BOUNDS.model_copy(update={"max_p99_ms": 30.0}), True, "max_p99_ms 30.0"),
        (40, 0, 31.0, 100, BOUNDS.model_copy(update={"max_p99_ratio": None}), False, None),
    ],
)
def test_canary_verdict_table(
    canary_n: int, canary_errors: int, canary_ms: float, stable_n: int, bounds: CanarySettings,
    rollback: bool, reason_part: str | None,
) -> None:
    samples = [*_samples("1", "stable", stable_n), *_samples("2", "canary", canary_n, canary_errors, canary_ms)]
    verdict = canary_verdict(samples, bounds, canary="2", stable="1")
    assert verdict.rollback is rollback
    if reason_part is None:
        assert verdict.reason is None
    else:
        assert verdict.reason is not None and reason_part in verdict.reason
    assert verdict.canary is not None and verdict.canary.requests == canary_n
    assert verdict.figures()["canary"]["requests"] == canary_n


class _CountingRedis:
    """Answers GET with a stored state and counts the reads (the Router's only Redis call)."""

    def __init__(self, raw: bytes | None) -> None:
        self.raw = raw
        self.gets = 0

    def get(self, key: str) -> bytes | None:
        self.gets += 1
        return self.raw


def test_router_reads_the_state_at_most_once_per_cache_period() -> None:
    from producer.routing import Router
    from protocol.settings import load_settings

    settings = load_settings(None, models={"m": {"path": "/nonexistent.onnx"}})
    fake = _CountingRedis(_state(100 - 1).model_dump_json().encode())
    now = [0.0]
    router = Router(fake, settings, cache_s=1.0, clock=lambda: now[0])  # type: ignore[arg-type]
    queues = {router.choose("m", f"k{i}") for i in range(200)}
    assert queues == {"fleet.m", "fleet.m.canary"} and fake.gets == 1
    now[0] = 0.99
    router.choose("m", "k")
    assert fake.gets == 1
    fake.raw = None  # the canary was dropped: seen once the cached state is 1 s old
    now[0] = 1.0
    assert {router.choose("m", f"k{i}") for i in range(200)} == {"fleet.m"} and fake.gets == 2
    assert router.queue("m", "canary") == "fleet.m.canary"


def test_verdict_without_a_pin_compares_with_the_configured_version() -> None:
    samples = [*_samples("1.0.0", "stable", 100), *_samples("2", "canary", 40, latency_ms=31.0)]
    verdict = canary_verdict(samples, BOUNDS, canary="2", stable=None)
    assert verdict.rollback and verdict.stable is not None and verdict.stable.version == "1.0.0"
    assert verdict.reason is not None and "stable 1.0.0 p95 10.0 ms" in verdict.reason  # 40 canary requests: p95


def test_one_prompt_in_20_is_sampled_apart_from_routing() -> None:
    ids = [f"req-{i}" for i in range(20_000)]
    sampled = {rid for rid in ids if samples_prompt(rid)}
    assert abs(len(sampled) / len(ids) - 0.05) < 0.006
    on_canary = {rid for rid in ids if route(_state(10), rid) == "canary"}
    assert 0.07 < len(sampled & on_canary) / len(sampled) < 0.13  # independent of the routing hash


@pytest.mark.parametrize(
    ("requests", "expected"),
    [(0, None), (1, None), (2, 50), (3, 50), (4, 75), (9, 75), (10, 90), (19, 90), (20, 95), (99, 95), (100, 99),
     (5000, 99)],
)
def test_supported_percentile_is_never_the_samples_maximum(requests: int, expected: int | None) -> None:
    assert supported_percentile(requests) == expected
    if expected is not None:  # its nearest rank is below the maximum: one outlier cannot be it
        values = [1.0] * (requests - 1) + [1000.0]
        assert percentile(values, expected) == 1.0


def _with_outliers(version: str, role: str, n: int, ms: float, slow: int, slow_ms: float) -> list[Outcome]:
    return [Outcome(version, "canary" if role == "canary" else "stable", True, slow_ms if i < slow else ms,
                    1000.0 + i) for i in range(n)]


@pytest.mark.parametrize(
    ("canary_n", "slow", "stable_n", "bounds", "rollback", "judged", "reason_part"),
    [
        # the observed case: one GC pause among 14 canary requests was its "p99" (its maximum): no rollback now
        (14, 1, 100, BOUNDS.model_copy(update={"min_requests": 10}), False, 90, None),
        (20, 1, 100, BOUNDS, False, 95, None),  # the default min_requests: p95, the 19th of 20
        (20, 1, 0, BOUNDS.model_copy(update={"max_p99_ms": 50.0}), False, 95, None),  # the absolute bound too
        (99, 1, 200, BOUNDS, False, 95, None),
        # a real tail still rolls back, at the percentile the sample supports, which the reason names
        (20, 2, 100, BOUNDS, True, 95, "canary 2 p95 86.2 ms > max_p99_ratio 3.0 x stable 1 p95 7.2 ms (p95: the "
                                       "highest percentile 20 requests support; p99 needs 100)"),
        (14, 2, 100, BOUNDS.model_copy(update={"min_requests": 10}), True, 90, "p90 86.2 ms > max_p99_ratio"),
        (20, 2, 0, BOUNDS.model_copy(update={"max_p99_ms": 50.0}), True, 95, "canary 2 p95 86.2 ms > max_p99_ms 50.0"),
        # from 100 requests: p99, without a note
        (100, 2, 100, BOUNDS, True, 99, "canary 2 p99 86.2 ms > max_p99_ratio 3.0 x stable 1 p99 7.2 ms"),
        (200, 2, 200, BOUNDS, False, 99, None),  # 1 % slow: the p99 is the 198th of 200
        # the ratio is judged at the percentile both samples support
        (100, 6, 20, BOUNDS, True, 95, "stable 1 p95 7.2 ms (p95: the highest percentile 20 requests support"),
        (100, 2, 20, BOUNDS, False, 95, None),
    ],
)
def test_latency_is_judged_at_the_percentile_the_sample_supports(
    canary_n: int, slow: int, stable_n: int, bounds: CanarySettings, rollback: bool, judged: int,
    reason_part: str | None,
) -> None:
    samples = [*_with_outliers("1", "stable", stable_n, 7.22, 0, 0.0),
               *_with_outliers("2", "canary", canary_n, 8.79, slow, 86.2)]
    verdict = canary_verdict(samples, bounds, canary="2", stable="1")
    assert verdict.rollback is rollback, verdict.reason
    assert verdict.latency is not None and verdict.latency.percentile == judged
    assert verdict.figures()["latency_judged"]["percentile"] == judged
    if reason_part is None:
        assert verdict.reason is None
    else:
        assert verdict.reason is not None and reason_part in verdict.reason, verdict.reason


def test_an_unserved_canary_verdict_names_the_versions_that_computed_its_requests() -> None:
    # 3.0.0 was refused everywhere; a worker kept the replaced canary 1.0.1, the other ran the queue on stable
    samples = [*_samples("2.0.0", "stable", 20), *_samples("1.0.1", "canary", 30), *_samples("2.0.0", "canary", 4)]
    refused = [("wA", "ChecksumMismatch: bad bytes"), ("wB", "ChecksumMismatch: bad bytes")]
    verdict = canary_verdict(samples, BOUNDS, canary="3.0.0", stable=None)
    assert verdict.stable is not None and verdict.stable.version == "2.0.0"  # the stable role's, not the busiest
    verdict = unserved_canary_verdict(verdict, samples, "3.0.0", refused, BOUNDS.min_requests)
    assert verdict.rollback and verdict.reason is not None
    assert "computed none of the 34 canary requests in the window (computed by 1.0.1: 30, stable 2.0.0: 4)" \
        in verdict.reason, verdict.reason
    assert "stable served them" not in verdict.reason
    queue = {f["version"]: f["requests"] for f in verdict.figures()["canary_queue"]}
    assert queue == {"1.0.1": 30, "2.0.0": 4}


def test_an_unserved_canary_whose_queue_ran_on_stable_says_so() -> None:
    # what a worker without the canary records: the stable engine computed them (role), the queue was the canary's
    on_stable = [Outcome("2.0.0", "stable", True, 10.0, 1000.0 + i, asked="canary") for i in range(25)]
    samples = [*_samples("2.0.0", "stable", 20), *on_stable]
    verdict = canary_verdict(samples, BOUNDS, canary="3.0.0", stable="2.0.0")
    verdict = unserved_canary_verdict(verdict, samples, "3.0.0", [("wA", "ChecksumMismatch: x")], BOUNDS.min_requests)
    assert verdict.rollback and verdict.reason is not None and "(computed by stable 2.0.0: 25)" in verdict.reason
