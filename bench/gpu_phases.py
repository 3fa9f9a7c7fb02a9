"""``fleet gpu-report``'s measuring phases: models, node placement, engine ceiling, the fleet, scaling,
generation, host↔device transfers and decode steps as CUDA graphs (sections 3 to 6 of :mod:`bench.gpu_report`).

Every phase imports what it runs (ONNX Runtime, onnx, the workers, the bench's load clients) inside itself:
``fleet <any command>`` imports :mod:`bench.gpu_report` (and so this module) to register ``gpu-report``.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench.gpu_plan import ReportPlan, Say

__all__ = [
    "build_report_models",
    "ceiling_phase",
    "decode_graphs_phase",
    "fleet_phase",
    "generation_phase",
    "inplace_transfer_phase",
    "placement_phase",
    "scaling_phase",
    "transfer_phase",
]


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


def _graph_of(path: Path) -> Any:
    """The ONNX graph of ``path`` without its external weights (onnx is imported here: 0.8 s of CPU that
    registering ``gpu-report`` with every ``fleet`` command must not cost)."""
    import onnx

    return onnx.load(str(path), load_external_data=False)
