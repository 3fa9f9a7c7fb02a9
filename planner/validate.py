"""The model against a real fleet on this machine: ``python -m planner.validate`` (docs) and the CI test.

:func:`check` runs the procedure on a fleet someone else started (the test's fixtures, or
:func:`main`'s embedded one): a backlog queued before the worker starts gives this machine's
capacity; a Poisson trace at a quarter of it with a burst at 1.5x for ``burst_s`` is replayed for
real; the model, given the service the worker reported in that run (:func:`planner.replay.calibrate`)
and the submit times that really happened, predicts p50/p99 queue wait. Wrong models (two workers
instead of one, engine time only, no micro-batching) are run beside it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from planner.model import FleetShape, Outcome, simulate
from planner.replay import (
    Agreement,
    Calibration,
    Measured,
    agreement,
    calibrate,
    collect,
    replay,
    submit_trace,
)
from planner.scaler import ScalerSettings
from planner.trace import Burst, poisson

if TYPE_CHECKING:
    from producer.client import FleetClient

__all__ = ["MODEL", "PROMPT", "Validation", "build_model", "check", "main", "model_config"]

MODEL = "plan-lm"
PROMPT = list(range(3, 35))
"""32 tokens."""


def build_model(root: Path) -> Path:
    """The LM the check serves: 6 layers, width 384 (engine ~14 ms a lone batch, ~55 ms for 8 on an idle core)."""
    from tools.build_lm import build_causal_lm

    return build_causal_lm(root, name=MODEL, num_layers=6, hidden_size=384, num_heads=8, vocab_size=512,
                           max_positions=128)


def model_config(path: Path) -> dict[str, Any]:
    """Its ``models.<name>`` entry: batches of up to 8 within 2 ms, one intra-op thread."""
    return {"path": str(path), "batching": {"max_batch_size": 8, "max_wait_ms": 2.0},
            "limits": {"max_input_tokens": 64}, "engine": {"intra_op_threads": 1}}


def _fixed(workers: int) -> ScalerSettings:
    return ScalerSettings(min_replicas=workers, max_replicas=workers, held_threshold=None)


@dataclass(frozen=True)
class Validation:
    """One real run and the model's predictions for it."""

    calibration: Calibration
    capacity_rps: float
    real: Measured
    predicted: Outcome
    wrong: dict[str, Outcome]

    def agreements(self, outcome: Outcome | None = None) -> list[Agreement]:
        """p50 and p99 of ``outcome`` (default: the model's prediction) against the real run."""
        sim = self.predicted if outcome is None else outcome
        return [agreement(q, sim.percentile_ms(q), self.real.percentile_ms(q)) for q in (50, 99)]

    def passes(self, outcome: Outcome | None = None) -> bool:
        """Whether ``outcome`` agrees at both p50 and p99 (the check a model must pass)."""
        return all(a.ok for a in self.agreements(outcome))

    def to_json(self) -> dict[str, Any]:
        """Figures for docs/plan.md (ms, requests/s)."""
        cal = self.calibration
        return {
            "requests": len(self.real.queue_wait_ms),
            "capacity_rps": round(self.capacity_rps, 1),
            "calibration": {"request_cpu_ms": round(cal.request_cpu_ms, 2), "fetch_ms": round(cal.fetch_ms, 2),
                            "batch_ms": {str(n): round(ms, 2) for n, ms in cal.service.points}},
            "mean_batch_size": round(float(self.real.batch_size.mean()), 2),
            "measured": {f"p{q}": round(self.real.percentile_ms(q), 1) for q in (50, 99)},
            "predicted": {f"p{q}": round(self.predicted.percentile_ms(q), 1) for q in (50, 99)},
            "tolerance": {f"p{a.percentile:g}": [round(a.low_ms, 1), round(a.high_ms, 1)] for a in self.agreements()},
            "agrees": self.passes(),
            "wrong_models": {name: {f"p{q}": round(o.percentile_ms(q), 1) for q in (50, 99)}
                             | {"passes": self.passes(o)} for name, o in self.wrong.items()},
        }


def check(client: FleetClient, start_worker: Callable[[], object], *, trace_s: float = 8.0, burst_s: float = 2.0,
          backlog: int = 80, seed: int = 7) -> Validation:
    """Run the procedure (module docstring); ``start_worker`` starts the one worker and returns once it is ready."""
    ids, submitted = submit_trace(client, MODEL, [0.0] * backlog, PROMPT)
    start_worker()
    capacity = calibrate(collect(client, ids, submitted)).capacity_rps(8)
    trace = poisson(capacity / 4, trace_s, bursts=(Burst((trace_s - burst_s) / 2, burst_s, 6.0),), seed=seed)
    real = replay(client, MODEL, trace.arrival_s.tolist(), PROMPT, timeout_s=120.0 + 4 * trace_s)
    cal = calibrate(real)
    shape = cal.shape(FleetShape(max_batch_size=8, max_wait_ms=2.0, concurrency=8))
    arrivals = real.as_trace()
    wrong = {"two workers": simulate(arrivals, cal.service, shape, _fixed(2)),
             "engine time only": simulate(arrivals, cal.service, replace(shape, request_cpu_ms=0.0), _fixed(1)),
             "no micro-batching": simulate(arrivals, cal.service, replace(shape, max_batch_size=1), _fixed(1))}
    return Validation(cal, capacity, real, simulate(arrivals, cal.service, shape, _fixed(1)), wrong)


def main(argv: list[str] | None = None) -> int:
    """Start a private redis-server and one worker, run :func:`check`, write the figures as JSON."""
    from producer.client import FleetClient
    from protocol.settings import load_settings
    from tools.processes import WorkerProcess
    from tools.redis_server import EmbeddedRedis

    parser = argparse.ArgumentParser(description="fleet plan's model vs a real run on this machine")
    parser.add_argument("--trace-s", type=float, default=30.0, help="length of the replayed trace (s)")
    parser.add_argument("--burst-s", type=float, default=4.0, help="length of its burst (s)")
    parser.add_argument("--out", type=Path, default=Path("docs/plan-validate.json"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis() as server:
        root = Path(tmp)
        config = root / "fleet.yaml"
        config.write_text(yaml.safe_dump({"redis_url": server.url, "result_ttl_s": 600,
                                          "worker": {"model": MODEL, "concurrency": 8},
                                          "models": {MODEL: model_config(build_model(root / "models"))}}))
        settings = load_settings(config)
        client = FleetClient(settings)
        worker = WorkerProcess(model=MODEL, queue=settings.queue_for(MODEL), redis_url=server.url, concurrency=8,
                               hostname=f"validate-{MODEL}@local", env={"FLEET_CONFIG": str(config)},
                               log_path=root / "worker.log")
        try:
            result = check(client, lambda: worker.start().wait_ready(120), trace_s=args.trace_s, burst_s=args.burst_s,
                           backlog=160)
        finally:
            worker.stop(timeout_s=15)
            client.close()
    doc = result.to_json()
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc, indent=1))
    return 0 if doc["agrees"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
