"""``fleet models compare``'s per-version figures (pure): no p99 below the 100 requests that support one, the
tail at the percentile the requests do support, named, and the slowest request named as the maximum."""

from __future__ import annotations

import pytest

from protocol.canary_verdict import Outcome, supported_percentile, version_figures


def _outcomes(version: str, latencies_ms: list[float], errors: int = 0) -> list[Outcome]:
    return [Outcome(version, "canary", i >= errors, ms, 1000.0 + i) for i, ms in enumerate(latencies_ms)]


def _one_slow(n: int, fast_ms: float = 10.0, slow_ms: float = 500.0) -> list[float]:
    """``n`` requests, one of them a GC pause."""
    return [fast_ms] * (n - 1) + [slow_ms]


@pytest.mark.parametrize(
    ("n", "p99_ms", "tail_percentile", "tail_ms", "tail"),
    [
        (1, None, None, None, "n/a (n=1; needs 2)"),
        (2, None, 50, 10.0, "p50 (n=2)"),
        (14, None, 90, 10.0, "p90 (n=14)"),  # before: "p99_ms" 500.0, the GC pause
        (40, None, 95, 10.0, "p95 (n=40)"),
        (99, None, 95, 10.0, "p95 (n=99)"),
        (100, 10.0, 99, 10.0, "p99 (n=100)"),  # from 100 requests the p99 is below the maximum
        (1000, 10.0, 99, 10.0, "p99 (n=1000)"),
    ],
)
def test_p99_only_from_100_requests_and_the_supported_tail_named(
    n: int, p99_ms: float | None, tail_percentile: int | None, tail_ms: float | None, tail: str
) -> None:
    figures = version_figures(_outcomes("2", _one_slow(n)))["2"]
    assert (figures.p99_ms, figures.tail_percentile, figures.tail_ms) == (p99_ms, tail_percentile, tail_ms)
    assert figures.tail_percentile == supported_percentile(n)  # the canary guard's rule
    assert figures.max_ms == 500.0 and figures.requests == n
    doc = figures.to_dict()
    assert doc["tail"] == tail and doc["p99_ms"] == p99_ms and doc["max_ms"] == 500.0


def test_the_tail_is_the_nearest_rank_at_the_supported_percentile() -> None:
    latencies = [float(ms) for ms in range(1, 41)]  # 40 requests: p95 is the 38th
    figures = version_figures(_outcomes("2", latencies[::-1]))["2"]
    assert (figures.p50_ms, figures.tail_percentile, figures.tail_ms, figures.max_ms) == (20.0, 95, 38.0, 40.0)


def test_json_keeps_the_original_keys_and_adds_the_tail() -> None:
    figures = version_figures([*_outcomes("1", [1.234] * 30, errors=3), *_outcomes("2", [5.0])])
    assert list(figures) == ["1", "2"]  # in the order versions first appear
    assert figures["1"].to_dict() == {
        "version": "1", "requests": 30, "errors": 3, "error_rate": 0.1, "p50_ms": 1.23, "p99_ms": None,
        "tail": "p95 (n=30)", "tail_percentile": 95, "tail_ms": 1.23, "max_ms": 1.23,
    }
    assert figures["2"].to_dict()["p50_ms"] == 5.0 and figures["2"].to_dict()["tail_ms"] is None

