"""Pure parts of the model lifecycle: sticky routing and its split, the canary verdict."""

from __future__ import annotations

import pytest

from protocol.canary_verdict import Outcome, canary_verdict, percentile, version_figures
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
    assert verdict.reason is not None and "stable 1.0.0 p99 10.0 ms" in verdict.reason


def test_one_prompt_in_20_is_sampled_apart_from_routing() -> None:
    ids = [f"req-{i}" for i in range(20_000)]
    sampled = {rid for rid in ids if samples_prompt(rid)}
    assert abs(len(sampled) / len(ids) - 0.05) < 0.006
    on_canary = {rid for rid in ids if route(_state(10), rid) == "canary"}
    assert 0.07 < len(sampled & on_canary) / len(sampled) < 0.13  # independent of the routing hash
