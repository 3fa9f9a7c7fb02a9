"""fleet plan's model against a real fleet on this machine: the same short trace, p50/p99 queue wait.

One real celery worker on a real redis-server serves an LM big enough for the engine to matter
(planner.validate.build_model). A backlog queued before the worker starts gives this machine's
capacity; a Poisson trace at a quarter of it with a 2 s burst at 1.5x is replayed for real and
through the model (fed the service the worker reported in that run and the real submit times).
The model's p50 and p99 queue wait must agree with the measured ones within a factor of 3 (or 10 ms)
(planner.replay.agreement), and a wrong model (two workers instead of one) must fall outside it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from planner.validate import MODEL, build_model, check, model_config
from tests.integration.fleet_fixtures import Fleet

pytestmark = pytest.mark.slow


ATTEMPTS = 2
"""Independent runs, each with a fresh worker: the first that agrees decides. A run measures a 2-core machine
shared with the rest of the suite, and another test's burst can land inside its 8 s trace: in one CI run at
375e35b the model predicted 87 ms at p50 against 279 ms measured (the band: 93-837 ms), where runs alone and
beside ``stress-ng --cpu 2`` agreed within 1.1x. A model that is wrong disagrees in every run."""


def test_simulated_queue_wait_agrees_with_a_real_run(fleet: Fleet, tmp_path: Path) -> None:
    config = fleet.config(models={MODEL: model_config(build_model(tmp_path / "models"))})
    client = fleet.client(config)
    for _attempt in range(ATTEMPTS):
        result = check(client, lambda: fleet.worker(config, MODEL, concurrency=8))
        fleet.workers[-1].stop(timeout_s=20)  # the next attempt starts its own worker on an empty queue
        print(result.to_json())
        if all(check_at.ok for check_at in result.agreements()):
            break
    for check_at in result.agreements():
        assert check_at.ok, check_at
    # a fleet of the wrong size is far outside (15 vs 511 ms at p50 in one run): the check can fail
    assert not result.passes(result.wrong["two workers"]), result.agreements(result.wrong["two workers"])
    # The engine-time-only and no-batching models are reported, not asserted: on a loaded machine the
    # calibrated batch cost grows almost linearly with the rows (10.5 ms + 8.9 per row in one CI run), and
    # then leaving out the per-request stage can predict longer waits (259.5 vs 238.2 ms at p50 there: the
    # stage spreads arrivals into more, smaller batches) as well as shorter ones (4x shorter in another).
    # The stage's own effect is checked where it is known by hand (tests/unit/test_planner_model.py).
