"""planner's pure parts: service-time interpolation, the KEDA/HPA rules, and the discrete-event model on
traces whose answer is known by hand (no Redis, no workers)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from planner.model import FleetShape, simulate
from planner.scaler import Autoscaler, ScalerSettings
from planner.service import ServiceTimes
from planner.trace import Trace

FIXED1 = ScalerSettings(min_replicas=1, max_replicas=1, held_threshold=None)
FLAT_10MS = ServiceTimes(((1, 10.0), (8, 10.0)))


def _trace(*arrivals: float) -> Trace:
    return Trace(np.asarray(arrivals, dtype=np.float64), max(arrivals))


@pytest.mark.parametrize(("size", "ms"), [(1, 10.0), (2, 15.0), (3, 20.0), (4, 30.0), (6, 50.0), (0, 10.0)])
def test_service_times_interpolate_and_extrapolate(size: int, ms: float) -> None:
    assert ServiceTimes(((1, 10.0), (3, 20.0), (4, 30.0))).batch_ms(size) == pytest.approx(ms)


def test_service_times_refuse_unsorted_sizes() -> None:
    with pytest.raises(ValueError, match="ascending"):
        ServiceTimes(((4, 1.0), (2, 1.0)))


def test_a_lone_request_waits_only_for_the_fetch() -> None:
    out = simulate(_trace(1.0), FLAT_10MS, FleetShape(fetch_ms=3.0, request_cpu_ms=2.0), FIXED1)
    assert out.queue_wait_ms.tolist() == pytest.approx([5.0])


def test_a_backlog_is_batched_and_drained_in_full_batches() -> None:
    # 16 requests in the same instant, batches of up to 8 taking 10 ms. The first finds the engine idle and
    # nothing else on its way, so it runs alone at once (close-when-idle, as the worker's policy does); the
    # other 15 gather meanwhile and go as 8 at 10 ms and 7 at 20 ms.
    out = simulate(_trace(*[0.0] * 16), FLAT_10MS, FleetShape(max_batch_size=8, concurrency=16), FIXED1)
    assert out.batches == 3
    assert sorted(out.queue_wait_ms.tolist()) == pytest.approx([0.0] + [10.0] * 8 + [20.0] * 7)


def test_without_batching_the_same_backlog_takes_eight_times_longer() -> None:
    shape = FleetShape(max_batch_size=1, concurrency=16)
    out = simulate(_trace(*[0.0] * 16), FLAT_10MS, shape, FIXED1)
    assert out.batches == 16 and out.percentile_ms(100) == pytest.approx(150.0)


def test_two_workers_halve_the_wait_of_a_backlog() -> None:
    shape = FleetShape(max_batch_size=1, concurrency=1)
    one = simulate(_trace(*[0.0] * 8), FLAT_10MS, shape, FIXED1)
    two = simulate(_trace(*[0.0] * 8), FLAT_10MS, shape, replace(FIXED1, min_replicas=2, max_replicas=2))
    assert one.percentile_ms(100) == pytest.approx(70.0) and two.percentile_ms(100) == pytest.approx(30.0)


def test_batches_never_exceed_max_batch_size() -> None:
    # The first alone at once (idle engine), then pairs every 10 ms.
    out = simulate(_trace(*[0.0] * 6), FLAT_10MS, FleetShape(max_batch_size=2, concurrency=2), FIXED1)
    assert sorted(out.queue_wait_ms.tolist()) == pytest.approx([0, 10, 10, 20, 20, 30])


def test_the_serial_per_request_stage_bounds_throughput() -> None:
    out = simulate(_trace(*[0.0] * 4), ServiceTimes(((1, 0.1),)), FleetShape(max_batch_size=1, concurrency=4,
                                                                          request_cpu_ms=5.0), FIXED1)
    assert sorted(out.queue_wait_ms.tolist()) == pytest.approx([5, 10, 15, 20])


def test_the_queue_cap_refuses_what_does_not_fit() -> None:
    shape = FleetShape(max_batch_size=1, concurrency=1, max_queue_depth=3)
    out = simulate(_trace(*[0.0] * 10), FLAT_10MS, shape, FIXED1)
    assert out.refused == 6 and out.queue_wait_ms.size == 4  # 1 taken at once, 3 queued, 6 refused


def test_a_fleet_at_zero_wakes_on_the_first_poll_and_serves_after_the_start_time() -> None:
    scaler = ScalerSettings(min_replicas=0, max_replicas=2, polling_interval_s=5.0, start_s=30.0,
                            held_threshold=None, cooldown_s=60.0)
    out = simulate(Trace(np.asarray([1.0]), 200.0), FLAT_10MS, FleetShape(), scaler)
    # Polled at 5 s (activates), ready at 35 s: the request waited 34 s.
    assert out.queue_wait_ms.tolist() == pytest.approx([34_000.0])
    # Last seen active at the 30 s poll (the request still waited); zero at the first poll 60 s later.
    assert out.timeline[-1][1] == 0
    assert out.replica_minutes == pytest.approx((90.0 - 5.0) / 60.0)


def test_autoscaler_scales_up_by_the_larger_trigger_and_at_most_double_plus_four() -> None:
    auto = Autoscaler(ScalerSettings(min_replicas=1, max_replicas=50, list_length=8, held_threshold=12))
    assert auto.decide(0.0, 1, waiting=16, held=0) == 2  # redis: 16/8
    assert auto.decide(5.0, 2, waiting=0, held=48) == 4  # prometheus: 48/12
    assert auto.decide(10.0, 4, waiting=400, held=0) == 8  # wants 50, max(2x4, 4+4)


def test_autoscaler_scales_down_only_after_the_stabilization_window() -> None:
    auto = Autoscaler(ScalerSettings(min_replicas=1, max_replicas=8, held_threshold=None,
                                     scale_down_stabilization_s=60.0, cooldown_s=600.0))
    assert auto.decide(0.0, 1, waiting=32, held=0) == 4
    assert auto.decide(30.0, 4, waiting=1, held=0) == 4  # recommendation 4 still in the window
    assert auto.decide(61.0, 4, waiting=1, held=0) == 1


def test_autoscaler_goes_to_zero_after_the_cooldown_only_when_min_is_zero() -> None:
    for low, expected in ((0, 0), (1, 1)):
        auto = Autoscaler(ScalerSettings(min_replicas=low, held_threshold=None, cooldown_s=100.0,
                                         scale_down_stabilization_s=0.0))
        auto.decide(0.0, 1, waiting=3, held=0)
        assert auto.decide(50.0, 1, waiting=0, held=0) == 1
        assert auto.decide(100.0, 1, waiting=0, held=0) == expected


def test_idle_replica_count_sleeps_at_zero_and_wakes_to_the_floor() -> None:
    auto = Autoscaler(ScalerSettings(min_replicas=3, idle_replicas=0, held_threshold=None, cooldown_s=100.0,
                                     scale_down_stabilization_s=0.0))
    assert auto.decide(0.0, 0, waiting=1, held=0) == 3  # activation goes straight to minReplicaCount
    assert auto.decide(50.0, 3, waiting=0, held=0) == 3
    assert auto.decide(100.0, 3, waiting=0, held=0) == 0  # idle for the cooldown: idleReplicaCount
    assert auto.decide(105.0, 0, waiting=0, held=0) == 0


@pytest.mark.parametrize("bad", [{"min_replicas": 1, "idle_replicas": 1}, {"min_replicas": 3, "max_replicas": 2},
                                 {"polling_interval_s": 0},
                                 {"list_length": 0}, {"held_threshold": 0}])
def test_scaler_settings_name_the_broken_field(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        ScalerSettings(**bad)  # type: ignore[arg-type]


def test_fleet_shape_refuses_a_batch_larger_than_the_tokens() -> None:
    with pytest.raises(ValueError, match="concurrency"):
        FleetShape(max_batch_size=16, concurrency=8)
