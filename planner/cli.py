"""CLI glue for ``fleet plan`` (see :mod:`planner`); ``register(subparsers)`` adds it.

    fleet plan --diurnal --hours 4 --peak-rps 100 --burst 7200:300:3     # a generated day with a burst
    fleet plan --trace traffic.csv --series fp32/short                    # a recorded trace
    fleet plan --validate                                                 # the model vs a real run here
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

__all__ = ["register", "run"]


def _numbers(text: str, kind: type[int] | type[float], flag: str) -> list[Any]:
    from protocol.errors import InvalidRequest

    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise InvalidRequest(f"{flag} must be comma-separated numbers, got {text!r}", flag, None) from exc
    if not values or min(values) < 0:
        raise InvalidRequest(f"{flag} needs at least one value, each >= 0, got {text!r}", flag, 0)
    return values


def _trace(args: argparse.Namespace) -> Any:
    from planner.trace import diurnal, load_trace, parse_burst, poisson

    bursts = tuple(parse_burst(b) for b in args.burst)
    if args.trace is not None:
        return load_trace(args.trace)
    if args.poisson_rps is not None:
        return poisson(args.poisson_rps, args.duration_s, bursts=bursts, seed=args.seed)
    return diurnal(args.hours, args.peak_rps, trough_rps=args.trough_rps, bursts=bursts, seed=args.seed)


def _plan(args: argparse.Namespace) -> dict[str, Any]:
    from planner.grid import best_row, run_grid
    from planner.model import FleetShape
    from planner.report import markdown_table, plot_grid, plot_timeline
    from planner.scaler import ScalerSettings
    from planner.service import load_service_times

    trace = _trace(args)
    service = load_service_times(args.service, args.series)
    shape = FleetShape(max_batch_size=args.max_batch_size, max_wait_ms=args.max_wait_ms,
                       concurrency=args.concurrency, max_queue_depth=args.max_queue_depth,
                       request_cpu_ms=args.request_cpu_ms, fetch_ms=args.fetch_ms)
    base = ScalerSettings(max_replicas=args.max_replicas, cooldown_s=args.cooldown_s, start_s=args.start_s,
                          held_threshold=args.held_threshold or None,
                          scale_down_stabilization_s=args.stabilization_s)
    rows = run_grid(trace, service, shape, base, list_lengths=_numbers(args.list_length, int, "--list-length"),
                    polling_intervals_s=_numbers(args.polling_interval, float, "--polling-interval"),
                    min_replicas=_numbers(args.min_replicas, int, "--min-replicas"), progress=not args.quiet)
    best = best_row(rows, args.slo_p99_ms)
    out: Path = args.out_dir
    (out / "img").mkdir(parents=True, exist_ok=True)
    table = markdown_table(rows, best)
    (out / "plan-grid.md").write_text(table)
    plot_grid(rows, best, args.slo_p99_ms, out / "img" / "plan-grid.png")
    cheapest = min(rows, key=lambda r: r.outcome.replica_minutes)
    shown = [("chosen", best)] if best is not None else []
    plot_timeline(trace, [*shown, ("cheapest", cheapest)], out / "img" / "plan-timeline.png")
    doc = {"requests": len(trace), "duration_s": trace.duration_s, "series": args.series,
           "service_batch_ms": {str(n): round(ms, 2) for n, ms in service.points},
           "shape": vars(shape), "base": vars(base), "slo_p99_ms": args.slo_p99_ms,
           "chosen": best.to_json() if best else None, "rows": [r.to_json() for r in rows]}
    (out / "plan-grid.json").write_text(json.dumps(doc, indent=1) + "\n")
    return {"chosen": doc["chosen"], "settings": len(rows), "requests": len(trace),
            "files": [str(out / n) for n in ("plan-grid.md", "plan-grid.json", "img/plan-grid.png",
                                              "img/plan-timeline.png")]}


def run(args: argparse.Namespace) -> int:
    """Run the grid (or the real-run check with ``--validate``); print a JSON summary."""
    from protocol.errors import InvalidRequest

    if args.validate:
        from planner.validate import main as validate_main

        return validate_main(["--out", str(args.out_dir / "plan-validate.json")])
    try:
        summary = _plan(args)
    except ValueError as exc:  # TraceError and the settings' own checks: bad input, nothing simulated
        raise InvalidRequest(str(exc), "fleet plan", None) from exc
    print(json.dumps(summary))
    return 0


def register(sub: Any) -> None:
    """Add ``fleet plan`` to the ``fleet`` subcommands."""
    p = sub.add_parser("plan", help="choose KEDA's knobs by simulation: replay a trace through a model of the fleet")
    src = p.add_argument_group("traffic (one of)")
    src.add_argument("--trace", type=Path, help="a .csv or .jsonl file: arrival_s [, prompt_tokens] per request")
    src.add_argument("--diurnal", action="store_true", help="a generated day-shaped curve (the default)")
    src.add_argument("--poisson-rps", type=float,
                     help="a constant-rate Poisson trace instead (requests/s; default: none, the diurnal curve)")
    src.add_argument("--duration-s", type=float, default=600.0,
                     help="length of the Poisson trace (s; default %(default)s)")
    src.add_argument("--hours", type=float, default=4.0,
                     help="length of the diurnal trace: trough-peak-trough (hours; default %(default)s)")
    src.add_argument("--peak-rps", type=float, default=100.0, help="diurnal peak (requests/s; default %(default)s)")
    src.add_argument("--trough-rps", type=float, help="diurnal trough (requests/s; default peak/10)")
    src.add_argument("--burst", action="append", default=[], metavar="START_S:DURATION_S:MULT",
                     help="multiply the rate by MULT for DURATION_S seconds from START_S (repeatable; default: none)")
    src.add_argument("--seed", type=int, default=0, help="seed of the generated trace (default %(default)s)")
    svc = p.add_argument_group("fleet")
    svc.add_argument("--service", type=Path, default=Path("docs/benchmarks.json"),
                     help="per-batch service times: fleet bench's JSON or {\"batch_ms\": {size: ms}} "
                     "(default %(default)s)")
    svc.add_argument("--series", default="fp32/short",
                     help="the benchmarks.json series VARIANT/LENGTH (default %(default)s)")
    svc.add_argument("--max-batch-size", type=int, default=8, help="requests per batch at most (default %(default)s)")
    svc.add_argument("--max-wait-ms", type=float, default=2.0,
                     help="batch window: the oldest request waits at most this long (ms; default %(default)s)")
    svc.add_argument("--concurrency", type=int, default=16, help="tokens per worker replica (default %(default)s)")
    svc.add_argument("--max-queue-depth", type=int, default=10_000,
                     help="admission cap in requests; beyond it 429 (default %(default)s)")
    svc.add_argument("--request-cpu-ms", type=float, default=5.4,
                     help="serial per-request worker cost (ms; default %(default)s: worker CPU-ms per request, "
                          "docs/benchmarks.md)")
    svc.add_argument("--fetch-ms", type=float, default=0.0, help="queue to worker latency (ms; default %(default)s)")
    sc = p.add_argument_group("autoscaler (KEDA ScaledObject)")
    sc.add_argument("--list-length", default="4,8,16",
                    help="redis trigger listLength values to try, comma-separated (default %(default)s)")
    sc.add_argument("--polling-interval", default="5,15,30",
                    help="pollingInterval values to try, comma-separated (s; default %(default)s)")
    sc.add_argument("--min-replicas", default="0,1",
                    help="minReplicaCount values to try, comma-separated (default %(default)s)")
    sc.add_argument("--max-replicas", type=int, default=8, help="maxReplicaCount (default %(default)s)")
    sc.add_argument("--cooldown-s", type=float, default=300.0,
                    help="cooldownPeriod: idle time before scaling to zero (s; default %(default)s)")
    sc.add_argument("--start-s", type=float, default=60.0,
                    help="pod start to ready: image, model load, warm-up, TensorRT engine build "
                    "(s; default %(default)s)")
    sc.add_argument("--held-threshold", type=int, default=12,
                    help="prometheus trigger: waiting + held per replica (0 = no such trigger; default %(default)s)")
    sc.add_argument("--stabilization-s", type=float, default=300.0,
                    help="HPA scale-down stabilization window (s; default %(default)s)")
    p.add_argument("--slo-p99-ms", type=float, default=1000.0,
                   help="p99 queue wait the chosen setting must keep (ms; default %(default)s)")
    p.add_argument("--out-dir", type=Path, default=Path("docs"),
                   help="writes plan-grid.md, plan-grid.json and img/plan-*.png here (default %(default)s)")
    p.add_argument("--validate", action="store_true", help="instead: the model vs a real run on this machine")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
