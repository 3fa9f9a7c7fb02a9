"""CLI glue for ``fleet bench`` (see :mod:`bench.runner`); ``register(subparsers)`` adds it.

``fleet bench`` runs the full table (~18 minutes on 2 cores, with generation, same weights, guidellm) and rewrites
``docs/benchmarks.md``, ``docs/benchmarks.json`` and the plots in ``docs/img/``; ``fleet bench --only
generation`` reruns the generation rows alone (~5 minutes) into the same files, ``fleet bench --only dispatch
--label after`` the dispatch cost per path (~3 minutes); ``fleet bench --quick``
is the CI smoke run (demo model, ~60 s, no peer), written to ``var/bench-quick/`` unless ``--out`` says
otherwise.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

__all__ = ["PROVIDER_ENV", "main", "register", "run"]

PROVIDER_ENV = "FLEET_BENCH_PROVIDER"
"""The environment setting behind ``--provider`` (the flag wins)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``bench`` flags."""
    p.add_argument("--quick", action="store_true", help="CI smoke run: demo model, short phases, no peer (< ~60 s)")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="Markdown report (default docs/benchmarks.md; --quick: var/bench-quick/benchmarks.md)",
    )
    p.add_argument("--img-dir", type=Path, default=None, help="PNG plots (default: img/ next to the report)")
    p.add_argument(
        "--json",
        dest="json_path",
        type=Path,
        default=None,
        help="raw results (default: benchmarks.json next to the report)",
    )
    p.add_argument(
        "--work-dir",
        type=Path,
        default=Path("var/bench"),
        help="models, generated worker configs and logs (default var/bench)",
    )
    p.add_argument(
        "--peer-venv",
        type=Path,
        default=Path("var/peer-venv"),
        help="virtualenv of the celery-batches peer (created on first use, ~20 s; default %(default)s)",
    )
    p.add_argument("--no-peer", action="store_true", help="skip the celery-batches peer row")
    p.add_argument(
        "--provider",
        choices=["cpu", "cuda", "tensorrt"],
        default=None,
        help="execution providers of every phase (limit, workers, generation): cpu, cuda (CUDA → CPU) or "
        "tensorrt (TensorRT → CUDA → CPU); checked before anything runs (default: $FLEET_BENCH_PROVIDER, else cpu)",
    )
    p.add_argument(
        "--only",
        choices=["generation", "dispatch", "multiturn", "kvcache", "spinning", "streaming", "guidellm", "gateway",
                 "same-weights"],
        default=None,
        help="rerun one phase alone and merge its figures into the --json results of an earlier run; "
        "multiturn: the conversation rows (prefix reuse, routing) alone, into multiturn.md/.json beside --out; "
        "kvcache: the Concat against the in-place KV cache (step time against the past, a burst), into "
        "kvcache.md/.json beside --out; spinning: ONNX Runtime spin-waiting off, on and bounded on generation "
        "and one-step work, into spinning.md/.json beside --out; streaming: the stream publisher's CPU, one XADD per "
        "event against coalesced, into streaming.md/.json beside --out; guidellm: guidellm's sweep against the "
        "gateway, into guidellm.md/.json beside --out; gateway: each HTTP route against the FleetClient "
        "(req/s, latency, CPU per request), into gateway.md/.json beside --out; same-weights: the fleet against a "
        "bare numpy + ONNX Runtime loop and onnxruntime-genai's og.Engine on the same Llama weights, into "
        "same-weights.md/.json beside --out",
    )
    p.add_argument(
        "--label",
        default="latest",
        help="--only dispatch: name of this run in the before/after table (e.g. before, after; default %(default)s)",
    )
    p.add_argument(
        "--dispatch-json",
        type=Path,
        default=None,
        help="--only dispatch: also write this run's dispatch figures alone to this file",
    )
    p.add_argument(
        "--render-only",
        action="store_true",
        help="measure nothing: rewrite the report and plots from the --json results of an earlier run",
    )


def register(subparsers: Any) -> None:
    """Add the ``bench`` sub-command to an ``argparse`` sub-parsers object."""
    p = subparsers.add_parser(
        "bench",
        help="run the load harness and regenerate docs/benchmarks.md (--quick: CI smoke run)",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    add_arguments(p)
    p.set_defaults(func=run)


STANDALONE_PHASES = {
    "multiturn": ("bench.multiturn", "run_multiturn_only"),
    "kvcache": ("bench.kvcache", "run_kvcache_only"),
    "spinning": ("bench.spinning", "run_spinning_only"),
    "streaming": ("bench.streaming", "run_streaming_only"),
    "guidellm": ("bench.guidellm_sweep", "run_guidellm_only"),
    "gateway": ("bench.gateway_paths", "run_gateway_only"),
    "same-weights": ("bench.same_weights", "run_same_weights_only"),
}
"""``--only`` phases that run alone into their own page: (module, function(quick, preset, out_dir, work_dir,
command, machine_facts))."""


def run(args: argparse.Namespace) -> int:
    """Run the bench; returns the exit status (0 when every phase ran)."""
    from bench.plan import full_plan, quick_plan
    from bench.runner import run_bench

    plan = quick_plan() if args.quick else full_plan(peer=not args.no_peer)
    provider = getattr(args, "provider", None) or os.environ.get(PROVIDER_ENV, "cpu")
    if provider not in ("cpu", "cuda", "tensorrt"):
        print(f"fleet bench: {PROVIDER_ENV}={provider!r} is not one of ['cpu', 'cuda', 'tensorrt']", file=sys.stderr)
        return 2
    plan = replace(plan, provider=provider)
    if not args.render_only:
        from bench.machine import provider_unavailable

        reason = provider_unavailable(plan.provider)
        if reason is not None:  # before building models or starting anything: the run could only mislead
            print(f"fleet bench: --provider {plan.provider} cannot run on this machine: {reason}", file=sys.stderr)
            return 2
    if args.out is None:  # a quick smoke run never overwrites the documented table
        args.out = Path("var/bench-quick/benchmarks.md") if args.quick else Path("docs/benchmarks.md")
    args.img_dir = args.img_dir or args.out.parent / "img"
    args.json_path = args.json_path or args.out.parent / "benchmarks.json"
    command = (
        "fleet " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        if sys.argv[1:2] == ["bench"]
        else ("fleet bench" + (" --quick" if args.quick else "") + (" --no-peer" if args.no_peer else "")
              + (f" --only {args.only}" if args.only else "")
              + (f" --provider {plan.provider}" if plan.provider != "cpu" else ""))
    )
    if args.render_only:
        import json

        from bench.report import write_report

        write_report(json.loads(Path(args.json_path).read_text()), Path(args.out), Path(args.img_dir))
        print(f"fleet bench: rewrote {args.out} from {args.json_path}", file=sys.stderr)
        return 0
    if args.only == "generation":
        from bench.runner import run_generation_only

        run_generation_only(plan, args, command)
        return 0
    if args.only in STANDALONE_PHASES:  # each writes <phase>.md/.json beside --out
        import importlib

        from bench.machine import machine_facts

        module, function = STANDALONE_PHASES[args.only]
        getattr(importlib.import_module(module), function)(
            plan.quick, plan.preset, Path(args.out).parent, Path(args.work_dir), command, machine_facts)
        return 0
    if args.only == "dispatch":
        from bench.dispatch_only import run_dispatch_only

        run_dispatch_only(plan, args, command)
        return 0
    run_bench(plan, args, command)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.cli [flags]``: the same as ``fleet bench``."""
    parser = argparse.ArgumentParser(prog="python -m bench.cli", description="onnx-fleet load harness")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
