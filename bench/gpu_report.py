"""``fleet gpu-report``: the first command a GPU user runs (≤ ~5 minutes), Markdown + JSON.

It answers, on the machine it runs on, in one run:

1. **Environment**: the GPU (``nvidia-smi``: model, driver, CUDA version), the ONNX Runtime build
   actually imported, and the package versions.
2. **Providers**: TensorRT, CUDA and CPU, each loaded for real over a one-node graph; for one that
   does not load, why (the dynamic loader's own message, e.g. ``libnvinfer.so.10: cannot open shared
   object file``, or no GPU).
3. **Node placement** of every served graph (FP32, FP16, dynamic INT8, static QDQ INT8) on every chain
   that loads: how many nodes each provider ran in a profiled run (:mod:`workers.placement`).
4. **Engine ceiling** per batch size: bare ``session.run`` of the graph the workers serve, on the
   report's provider chain (:mod:`bench.limit`), requests per second.
5. **The fleet** on the same chain, side by side: one worker per configuration of the table
   (batch 1, batching, FP16, INT8, TensorRT FP16 when TensorRT loads), the per-request path
   (``fleet.infer``) and the bulk path (``fleet.infer_bulk``) at saturation, each as a share of
   the engine ceiling of its graph.
6. **Generation**: continuous batching against one request at a time and static batches (tokens/s), for
   the FP32 graph (the Concat cache on a GPU) and the FP16 one (the in-place cache where it applies: on a
   GPU, slots in device memory), and the bytes the decoder copied host↔device per generated token on each
   cache (:class:`workers.generation.decoder.Decoder` ``transfers``).

On a machine without a GPU it runs on the CPU chain and says why each GPU provider is missing, so
the same command (and its test) runs everywhere. Times are absolute wall-clock figures of the
machine in the header; ratios (fleet / ceiling) are measured in the same run.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.gpu_env import CHOICE_FOR, best_choice, environment, gpu_facts, provider_rows
from bench.gpu_env import COMMIT_ENV as COMMIT_ENV  # re-exported: the names stay importable from here
from bench.gpu_env import PROVIDERS as PROVIDERS
from bench.gpu_phases import (
    build_report_models,
    ceiling_phase,
    decode_graphs_phase,
    fleet_phase,
    generation_phase,
    inplace_transfer_phase,
    placement_phase,
    scaling_phase,
    transfer_phase,
)
from bench.gpu_plan import ReportPlan, Say, full_report_plan, quick_report_plan

__all__ = ["ReportPlan", "full_report_plan", "gpu_facts", "provider_rows", "quick_report_plan", "run_report"]


# -------------------------------------------------------------------------------------------------- run


def run_report(plan: ReportPlan, provider: str | None, work_dir: Path, say: Say) -> dict[str, Any]:
    """Every phase; returns the JSON-friendly results (see the module docstring).

    Args:
        provider: ``cpu``, ``cuda`` or ``tensorrt`` for the ceiling, fleet and generation phases; None
            = the best that loads here.

    Raises:
        ValueError: ``provider`` was asked for and cannot run here (the message says why).
    """
    from tools.redis_server import EmbeddedRedis

    started = time.monotonic()
    work_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"environment": environment()}
    rows = provider_rows()
    results["providers"] = rows
    choice = provider or best_choice(rows)
    wanted = next(r for r in rows if CHOICE_FOR[r["provider"]] == choice)
    if not wanted["loads"]:
        raise ValueError(f"--provider {choice} cannot run on this machine: {wanted['reason']}")
    results["provider"] = choice
    say(f"providers: {', '.join(CHOICE_FOR[r['provider']] + (' ok' if r['loads'] else ' no') for r in rows)}; "
        f"measuring on {choice}")  # fmt: skip
    phases: dict[str, float] = {}

    def timed(name: str, fn: Callable[[], Any]) -> Any:
        t0 = time.monotonic()
        say(f"{name} …")
        value = fn()
        phases[name] = round(time.monotonic() - t0, 1)
        return value

    models = timed("models", lambda: build_report_models(plan, work_dir, say))
    results["models"] = {k: {"path": v, "bytes": Path(v).stat().st_size} for k, v in models.items()}
    loading = [CHOICE_FOR[r["provider"]] for r in rows if r["loads"]]
    results["placement"] = timed("placement", lambda: placement_phase(models, loading, plan))
    results["ceiling"] = timed("ceiling", lambda: ceiling_phase(models, choice, plan, say))
    with EmbeddedRedis() as redis:
        results["fleet"] = timed("fleet", lambda: fleet_phase(models, choice, plan, rows, redis.url, work_dir, say))
        results["scaling"] = timed(
            "scaling", lambda: scaling_phase(models, choice, plan, redis.url, work_dir, say))
        results["generation"] = timed(
            "generation", lambda: generation_phase(models["fp32"], choice, plan, redis.url, work_dir, say))
        if "fp16" in models:
            results["generation_fp16"] = timed(
                "generation fp16", lambda: generation_phase(models["fp16"], choice, plan, redis.url, work_dir, say))
    results["transfers"] = timed("transfers", lambda: transfer_phase(models["fp32"], choice, plan))
    if "fp16" in models:
        results["transfers_in_place"] = timed(
            "transfers in place", lambda: inplace_transfer_phase(models["fp16"], choice, plan))
    # the FP16 graph is what a GPU chain serves in place; a CPU chain serves the FP32 one in place too
    graphs_model = models.get("fp16", models["fp32"])
    results["decode_graphs"] = timed("decode steps as CUDA graphs",
                                     lambda: decode_graphs_phase(graphs_model, choice, plan))
    results["shares"] = shares(results)
    results["meta"] = {"plan": {k: v for k, v in asdict(plan).items() if k != "generation"},
                       "phases_s": phases, "duration_s": round(time.monotonic() - started, 1),
                       "command": "fleet " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["gpu-report"]
                       else "fleet gpu-report"}  # fmt: skip
    return results


def shares(results: dict[str, Any]) -> dict[str, Any]:
    """Each fleet row's req/s as a share of the engine ceiling of its graph (best batch size, and the
    batch size the workers are capped at)."""
    model_of = {"baseline": "fp32", "batching": "fp32", "int8": "int8-dynamic", "fp16": "fp16"}
    out: dict[str, Any] = {}
    for key, row in results["fleet"].items():
        ceiling = results["ceiling"].get(model_of.get(key, ""))
        if ceiling is None:
            continue
        capped = max((p for p in ceiling["points"] if p["batch_size"] <= row["max_batch_size"]),
                     key=lambda p: float(p["qps"]))  # fmt: skip
        entry = {"ceiling_best_qps": ceiling["best"]["qps"], "ceiling_best_batch": ceiling["best"]["batch_size"],
                 "ceiling_capped_qps": capped["qps"], "ceiling_capped_batch": capped["batch_size"],
                 "per_request_of_best": row["per_request"]["qps"] / ceiling["best"]["qps"],
                 "per_request_of_capped": row["per_request"]["qps"] / capped["qps"]}  # fmt: skip
        if "bulk" in row:
            entry["bulk_of_best"] = row["bulk"]["qps"] / ceiling["best"]["qps"]
            entry["bulk_of_capped"] = row["bulk"]["qps"] / capped["qps"]
        out[key] = entry
    return out


def write_outputs(results: dict[str, Any], out: Path, json_path: Path) -> None:
    """The Markdown report and the raw JSON."""
    from bench.gpu_report_md import render

    out.parent.mkdir(parents=True, exist_ok=True)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    out.write_text(render(results, json_name=os.path.relpath(json_path, out.parent)))


def register(subparsers: Any) -> None:
    """Add the ``gpu-report`` sub-command."""
    p = subparsers.add_parser(
        "gpu-report",
        help="providers that load (and why the others do not), node placement, engine ceiling, the fleet's "
        "share of it, generation and host↔device bytes per token: Markdown + JSON (≤ ~5 min)",
        description=(__doc__ or "").split("\n\n")[0],
    )
    p.add_argument("--provider", choices=["cpu", "cuda", "tensorrt"], default=None,
                   help="chain of the ceiling, fleet and generation phases (default: the best that loads)")
    p.add_argument("--quick", action="store_true", help="smoke run: the demo model, short windows (~1–2 min on CPU)")
    p.add_argument("--out", type=Path, default=Path("var/gpu-report/gpu-report.md"),
                   help="Markdown report (default var/gpu-report/gpu-report.md)")
    p.add_argument("--json", dest="json_path", type=Path, default=None,
                   help="raw results (default: gpu-report.json next to --out)")
    p.add_argument("--work-dir", type=Path, default=Path("var/gpu-report/work"),
                   help="models, worker configs and logs (default var/gpu-report/work)")
    p.set_defaults(func=run)  # fmt: skip


def run(args: Any) -> int:
    """``fleet gpu-report``: exit 0 with both files written, 2 when ``--provider`` cannot run here."""
    plan = quick_report_plan() if args.quick else full_report_plan()
    json_path = args.json_path or args.out.with_suffix(".json")

    def say(msg: str) -> None:
        print(f"[gpu-report] {msg}", file=sys.stderr, flush=True)

    try:
        results = run_report(plan, args.provider, Path(args.work_dir), say)
    except ValueError as exc:
        print(f"fleet gpu-report: {exc}", file=sys.stderr)
        return 2
    write_outputs(results, Path(args.out), Path(json_path))
    say(f"done in {results['meta']['duration_s']:.0f} s: {args.out}, {json_path}")
    return 0



def main(argv: list[str] | None = None) -> int:
    """``python -m bench.gpu_report [flags]``: the same as ``fleet gpu-report``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m bench.gpu_report")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    return run(parser.parse_args(["gpu-report", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    raise SystemExit(main())
