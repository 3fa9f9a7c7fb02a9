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
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

__all__ = ["ReportPlan", "full_report_plan", "gpu_facts", "provider_rows", "quick_report_plan", "run_report"]

Say = Callable[[str], None]

COMMIT_ENV = "FLEET_GIT_COMMIT"
"""The commit to state when the tree is a copy without ``.git`` (e.g. shipped to a GPU machine)."""

PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")
"""Every execution provider the report probes, best first."""

CHOICE_FOR = {"TensorrtExecutionProvider": "tensorrt", "CUDAExecutionProvider": "cuda", "CPUExecutionProvider": "cpu"}
"""Provider → ``--provider`` choice whose chain starts with it (:data:`bench.machine.BENCH_PROVIDERS`)."""


@dataclass(frozen=True)
class ReportPlan:
    """Sizes of every phase of the report."""

    preset: str = "bench"
    """``tools.build_model`` preset whose LM is served (bench: ~27.6 M weights)."""
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    """Batch sizes of the engine ceiling."""
    ceiling_s: float = 0.6
    """Seconds of bare ``session.run`` per batch size."""
    prompts: int = 256
    prompt_tokens: tuple[int, int] = (8, 48)
    """Token range of the synthetic prompts (the bench's short workload)."""
    max_batch_size: int = 32
    concurrency: int = 64
    """Worker tokens C, and closed-loop clients of the per-request path."""
    max_wait_ms: float = 2.0
    fleet_s: float = 6.0
    """Seconds of each saturation window (per configuration and path)."""
    warmup_s: float = 1.0
    bulk_clients: int = 4
    bulk_chunk: int = 256
    """Requests per ``fleet.infer_bulk`` message."""
    quantize_static: bool = True
    """Also build static QDQ INT8 (the graph TensorRT runs in INT8)."""
    transfer_rows: int = 8
    transfer_steps: int = 32
    graph_rounds: int = 5
    """Rounds of the decode-graphs phase (each variant runs ``transfer_rows`` rows for ``transfer_steps`` steps)."""
    scale_workers: tuple[int, ...] = (1, 2, 4)
    """Worker processes of one model on the one device, started one step after another."""
    scale_processes: int = 4
    """Client processes of the scaling rows (:mod:`bench.load_procs`: one process cannot load several workers)."""
    scale_clients: int = 32
    """Closed-loop client threads per client process."""
    generation: Any = None
    """:class:`bench.plan.GenPlan` of the generation rows (None: the bench's quick plan's)."""
    quick: bool = False


def full_report_plan() -> ReportPlan:
    """The documented run (~5 minutes on a GPU machine)."""
    from bench.plan import GenPlan

    return ReportPlan(
        generation=GenPlan(
            max_batch_size=16, concurrency=32, prompt_tokens=(16, 64), output_tokens=(16, 64), requests=64,
            rounds=1, open_fractions=(0.5,), open_duration_s=3.0, open_min_requests=8, open_max_requests=24,
            warm_requests=2, limit_batch_sizes=(1, 4, 16), limit_steps=32, profile_runs=4,
        )
    )  # fmt: skip


def quick_report_plan() -> ReportPlan:
    """A smoke run (~1–2 minutes on 2 CPU cores): the demo model, short windows."""
    from bench.plan import quick_plan

    return ReportPlan(
        preset="demo", batch_sizes=(1, 8), ceiling_s=0.2, prompts=32, max_batch_size=8, concurrency=16,
        fleet_s=1.5, warmup_s=0.3, bulk_clients=2, bulk_chunk=32, quantize_static=True, transfer_rows=4,
        transfer_steps=8, graph_rounds=2, scale_workers=(1, 2), scale_processes=2, scale_clients=8,
        generation=quick_plan().generation, quick=True,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------- environment


def _run(cmd: list[str]) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip()


def gpu_facts() -> dict[str, Any]:
    """The GPUs ``nvidia-smi`` sees (model, memory, driver) and the CUDA version the driver supports.

    ``{"gpus": [], "reason": ...}`` without ``nvidia-smi`` or without a GPU.
    """
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {"gpus": [], "reason": "nvidia-smi not found (no NVIDIA driver on this machine)"}
    rows = _run([smi, "--query-gpu=name,memory.total,driver_version,compute_cap", "--format=csv,noheader"])
    gpus = []
    for line in rows.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3:
            gpus.append({"name": parts[0], "memory": parts[1], "driver": parts[2],
                         "compute_capability": parts[3] if len(parts) > 3 else "unknown"})  # fmt: skip
    cuda = re.search(r"CUDA Version:\s*([0-9.]+)", _run([smi]))
    out: dict[str, Any] = {"gpus": gpus, "driver_cuda": cuda.group(1) if cuda else "unknown"}
    if not gpus:
        out["reason"] = "nvidia-smi lists no GPU"
    return out


def provider_rows() -> list[dict[str, Any]]:
    """One row per provider of :data:`PROVIDERS`: in the imported build, loads, and why not.

    "Loads" means a real session over a one-node graph came up with that provider active
    (:func:`bench.machine.provider_unavailable`); the reason quotes the first missing piece.
    """
    import onnxruntime as ort

    from bench.machine import provider_unavailable

    available = ort.get_available_providers()
    rows = []
    for name in PROVIDERS:
        reason = None if name == "CPUExecutionProvider" else provider_unavailable(CHOICE_FOR[name])
        rows.append({"provider": name, "in_build": name in available, "loads": reason is None, "reason": reason})
    return rows


def best_choice(rows: list[dict[str, Any]]) -> str:
    """The best ``--provider`` choice that loads (tensorrt, then cuda, then cpu)."""
    return next(CHOICE_FOR[r["provider"]] for r in rows if r["loads"])


def environment() -> dict[str, Any]:
    """The machine, the GPU and the software of the run."""
    from bench.machine import machine_facts
    from workers.ort_session import imported_ort_build, preload_gpu_libraries

    facts = machine_facts()
    commit = facts["git_commit"] if facts["git_commit"] != "unknown" else os.environ.get(COMMIT_ENV, "unknown")
    return {
        "gpu": gpu_facts(),
        "onnxruntime": imported_ort_build(),
        "cuda_libraries": preload_gpu_libraries() if "CUDAExecutionProvider" in _available_providers()
        else "not needed: this onnxruntime build has no CUDA provider",
        "cpu": facts["cpu"], "logical_cores": facts["logical_cores"], "memory_gib": facts["memory_gib"],
        "os": facts["os"], "python": facts["python"], "packages": facts["packages"],
        "git_commit": commit,
        "git_dirty": facts["git_dirty"],
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }  # fmt: skip


# ------------------------------------------------------------------------------------------------ phases


def _prompts(plan: ReportPlan, vocab_size: int) -> list[list[int]]:
    from tools.calibration import synthetic_sequences

    lo, hi = plan.prompt_tokens
    return synthetic_sequences(plan.prompts, vocab_size=vocab_size, min_tokens=lo, max_tokens=hi, seed=7)


def build_report_models(plan: ReportPlan, work_dir: Path, say: Say) -> dict[str, str]:
    """FP32, FP16 (``fleet quantize --target cuda``), dynamic INT8 and (``quantize_static``) static QDQ INT8 of
    the preset's LM: name → path."""
    from bench.plan import quick_plan
    from bench.runner import build_models
    from tools.quantize import quantize_model
    from tools.quantize_config import QuantizeConfig

    bench_plan = replace(quick_plan(), preset=plan.preset, ablations=False, int8_variants=plan.quantize_static)
    built = build_models(bench_plan, work_dir, say)
    models = {"fp32": built["fp32"], "int8-dynamic": built["int8"]}
    fp16 = QuantizeConfig(mode="fp16", target="cuda", eval_count=16, latency_rounds=1, latency_prompts=4,
                          overwrite=True)
    written = quantize_model(Path(built["fp32"]), fp16, progress=False).path
    if written is not None:
        models["fp16"] = str(written)
    static = built["variants"].get("static", {})
    if static.get("written"):
        models["int8-static-qdq"] = static["output"]
    return models


def placement_phase(models: dict[str, str], choices: list[str], plan: ReportPlan) -> list[dict[str, Any]]:
    """Node placement of each model's served graph on each provider chain that loads."""
    from bench.limit import bare_parts
    from bench.machine import provider_chain_for
    from protocol.modelcard import load_card
    from tools.calibration import feeds_for
    from workers.engine import graph_input_names
    from workers.kv_dtype import graph_kv_dtype
    from workers.placement import profiled_placement

    rows = []
    for variant, path_str in models.items():
        path = Path(path_str)
        card = load_card(path)
        prompts = _prompts(plan, card.vocab_size)[:4]
        names = graph_input_names(path)  # the served graph's inputs are the file's (only the LM head is rewritten)
        dtype = graph_kv_dtype(_graph_of(path))
        for choice in choices:
            source, make_options, chain = bare_parts(path, providers=provider_chain_for(choice),
                                                     max_batch_size=plan.max_batch_size)  # fmt: skip
            placement = profiled_placement(source, make_options, chain, feeds_for(names, card, prompts, kv_dtype=dtype))
            rows.append({"model": variant, "chain": choice, "active": placement.active, "nodes": placement.nodes,
                         "total": placement.total})  # fmt: skip
    return rows


def ceiling_phase(models: dict[str, str], choice: str, plan: ReportPlan, say: Say) -> dict[str, Any]:
    """Bare ``session.run`` requests/s per batch size of each model on ``choice``'s chain."""
    from bench.limit import bare_latency_ms, bare_session, bare_throughput
    from bench.machine import provider_chain_for
    from protocol.modelcard import load_card

    out: dict[str, Any] = {}
    for variant, path_str in models.items():
        path = Path(path_str)
        card = load_card(path)
        prompts = _prompts(plan, card.vocab_size)
        sess = bare_session(path, providers=provider_chain_for(choice), max_batch_size=max(plan.batch_sizes))
        points = [
            asdict(bare_throughput(sess, card, prompts, b, duration_s=plan.ceiling_s, min_runs=3))
            for b in plan.batch_sizes
        ]
        best = max(points, key=lambda p: float(p["qps"]))
        out[variant] = {"points": points, "best": best, "lone_ms": bare_latency_ms(sess, card, prompts[:20]),
                        "active": sess.get_providers()}  # fmt: skip
        say(f"ceiling {variant}: best {best['qps']:.0f} req/s at batch {best['batch_size']}")
        del sess
    return out


def _fleet_configs(models: dict[str, str], choice: str, plan: ReportPlan, rows: list[dict[str, Any]],
                   work_dir: Path) -> dict[str, Any]:  # fmt: skip
    """The seed's table as worker configurations: batch 1, batching, INT8 and TensorRT FP16."""
    from bench.machine import provider_chain_for
    from bench.procs import FleetConfig

    chain = provider_chain_for(choice)
    base = FleetConfig(
        label="batching (FP32)", model_name="report-batching", model_path=Path(models["fp32"]),
        max_batch_size=plan.max_batch_size, max_wait_ms=plan.max_wait_ms, concurrency=plan.concurrency,
        celery_loglevel="WARNING", providers=chain,
        engine_extra={"require_provider": chain[0]} if choice != "cpu" else {},
    )  # fmt: skip
    configs = {
        "baseline": replace(base, label="one request per run (FP32, batch 1)", model_name="report-baseline",
                            max_batch_size=1),
        "batching": base,
        "int8": replace(base, label="batching, dynamic INT8", model_name="report-int8",
                        model_path=Path(models["int8-dynamic"])),
    }  # fmt: skip
    if "fp16" in models:
        configs["fp16"] = replace(base, label="batching, FP16", model_name="report-fp16",
                                  model_path=Path(models["fp16"]))
    trt = next((r for r in rows if r["provider"] == "TensorrtExecutionProvider"), {"loads": False})
    if trt["loads"]:
        configs["tensorrt-fp16"] = replace(
            base, label="batching, TensorRT FP16", model_name="report-trt-fp16",
            providers=("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"),
            engine_extra={"require_provider": "TensorrtExecutionProvider", "trt_fp16": True,
                          "cache_dir": str((work_dir / "trt-cache").resolve())},
        )  # fmt: skip
        if "int8-static-qdq" in models:
            configs["tensorrt-int8"] = replace(
                configs["tensorrt-fp16"], label="batching, TensorRT INT8 (static QDQ)", model_name="report-trt-int8",
                model_path=Path(models["int8-static-qdq"]),
            )  # fmt: skip
    return configs


def fleet_phase(models: dict[str, str], choice: str, plan: ReportPlan, rows: list[dict[str, Any]],
                redis_url: str, work_dir: Path, say: Say) -> dict[str, Any]:  # fmt: skip
    """Each configuration's saturation req/s on the per-request path, and the bulk path of ``batching``."""
    from bench.load import bulk_closed_loop, closed_loop
    from bench.rounds import start_fleet_servers
    from bench.stats import summarize_run
    from protocol.modelcard import load_card

    configs = _fleet_configs(models, choice, plan, rows, work_dir)
    prompts = _prompts(plan, load_card(Path(models["fp32"])).vocab_size)
    out: dict[str, Any] = {}
    servers = start_fleet_servers(configs, redis_url, work_dir)
    try:
        for key, server in servers.items():
            closed_loop(server.client, server.model, prompts, clients=plan.concurrency, max_requests=plan.concurrency)
            run = closed_loop(server.client, server.model, prompts, clients=plan.concurrency,
                              duration_s=plan.fleet_s + plan.warmup_s, warmup_s=plan.warmup_s)  # fmt: skip
            summary = summarize_run(run.records, run.window)
            entry: dict[str, Any] = {**server.info, "label": configs[key].label,
                                     "per_request": _summary_dict(summary)}  # fmt: skip
            say(f"fleet {key}: {summary.qps:.0f} req/s per request, batch {summary.mean_batch_size:.1f}")
            if key == "batching":
                bulk = bulk_closed_loop(server.client, server.model, prompts, clients=plan.bulk_clients,
                                        chunk=plan.bulk_chunk, duration_s=plan.fleet_s)  # fmt: skip
                bulk_summary = summarize_run(bulk.records)
                entry["bulk"] = {**_summary_dict(bulk_summary), "chunk": plan.bulk_chunk, "clients": plan.bulk_clients}
                say(f"fleet {key}: {bulk_summary.qps:.0f} req/s on the bulk path")
            out[key] = entry
    finally:
        for server in servers.values():
            server.stop()
    return out


def scaling_phase(models: dict[str, str], choice: str, plan: ReportPlan, redis_url: str, work_dir: Path,
                  say: Say) -> list[dict[str, Any]]:  # fmt: skip
    """FP32 batching served by 1, 2, 4 … worker processes on the same device (one queue), loaded by
    several client processes; req/s per step, workers started one step after another."""
    from bench.load_procs import closed_loop_processes
    from bench.procs import RunningFleet
    from protocol.modelcard import load_card

    base = _fleet_configs(models, choice, plan, [], work_dir)["batching"]
    vocab = load_card(Path(models["fp32"])).vocab_size
    fleets: list[RunningFleet] = []
    rows = []
    try:
        for count in plan.scale_workers:
            while len(fleets) < count:
                cfg = replace(base, label=f"scale-worker-{len(fleets) + 1}", model_name="report-scale")
                fleet = RunningFleet(cfg, redis_url, work_dir)
                fleets.append(fleet)
                fleet.start()
            figures = closed_loop_processes(
                fleets[0].config_path, "report-scale", 100 + count, processes=plan.scale_processes,
                clients=plan.scale_clients, duration_s=plan.fleet_s + plan.warmup_s, warmup_s=plan.warmup_s,
                vocab_size=vocab, prompt_tokens=plan.prompt_tokens,
            )  # fmt: skip
            rows.append({"workers": count, **{k: v for k, v in figures.items() if k != "children"},
                         "children": figures["children"]})  # fmt: skip
            say(f"scale: {count} worker(s), {figures['qps']:.0f} req/s ({figures['errors']} errors)")
    finally:
        for fleet in fleets:
            fleet.stop()
    return rows


def _summary_dict(summary: Any) -> dict[str, Any]:
    return {"qps": summary.qps, "requests": summary.requests, "errors": summary.errors,
            "p50_ms": summary.latency.p50_ms, "p99_ms": summary.latency.p99_ms,
            "mean_batch_size": summary.mean_batch_size}  # fmt: skip


def generation_phase(model: str, choice: str, plan: ReportPlan, redis_url: str, work_dir: Path,
                     say: Say) -> dict[str, Any]:  # fmt: skip
    """Continuous batching vs one request at a time vs static batches, through real workers."""
    from bench.generation import measure_generation
    from bench.machine import provider_chain_for
    from bench.plan import quick_plan

    gp = plan.generation or quick_plan().generation
    result = measure_generation(gp, Path(model), redis_url, work_dir, max_wait_ms=plan.max_wait_ms, seed=0,
                                say=say, providers=provider_chain_for(choice))  # fmt: skip
    rows = {}
    for key, row in result["rows"].items():
        sat = row.get("saturation") or {}
        rows[key] = {"label": row.get("label", key), "status": row.get("status"),
                     "tokens_per_s": sat.get("tokens_per_s"), "requests_per_s": sat.get("requests_per_s"),
                     "ttft_p50_ms": (sat.get("ttft") or {}).get("p50_ms"),
                     "inter_token_p50_ms": (sat.get("inter_token") or {}).get("p50_ms")}  # fmt: skip
    best = result["limit"]["best"]
    return {"rows": rows, "limit_best": best, "providers": result["providers"], "workload": result["workload"],
            "kv_in_place": result.get("kv_in_place"), "model": Path(model).name}


def transfer_phase(model: str, choice: str, plan: ReportPlan) -> dict[str, Any]:
    """Bytes the decoder copies host↔device per generated token: one prefill, then decode steps at a
    fixed membership, then one row leaving (a re-layout), read off the decoder's transfer meter."""
    from bench.transfers import measure_transfers

    return measure_transfers(Path(model), choice, rows=plan.transfer_rows, steps=plan.transfer_steps)


def inplace_transfer_phase(model: str, choice: str, plan: ReportPlan) -> dict[str, Any]:
    """The same script on the in-place cache (the FP16 graph: what a GPU chain serves in place)."""
    from bench.transfers import measure_inplace_transfers

    return measure_inplace_transfers(Path(model), choice, rows=plan.transfer_rows, steps=plan.transfer_steps)


def decode_graphs_phase(model: str, choice: str, plan: ReportPlan) -> dict[str, Any]:
    """Decode steps as CUDA graphs vs kernel by kernel on the in-place cache (:mod:`bench.cuda_graphs`)."""
    from bench.cuda_graphs import measure_decode_graphs

    return measure_decode_graphs(Path(model), choice, rows=plan.transfer_rows, steps=plan.transfer_steps,
                                 rounds=plan.graph_rounds)  # fmt: skip


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


def _available_providers() -> list[str]:
    import onnxruntime as ort  # here, not at the top: `fleet <any command>` imports this module to register it

    return list(ort.get_available_providers())


def _graph_of(path: Path) -> Any:
    """The ONNX graph of ``path`` without its external weights (onnx is imported here: 0.8 s of CPU that
    registering ``gpu-report`` with every ``fleet`` command must not cost)."""
    import onnx

    return onnx.load(str(path), load_external_data=False)


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
