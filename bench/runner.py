"""The bench run: models → the limit → every configuration of the table → dispatch cost → report.

Everything runs one after the other on the same machine, so ratios are measured side by side in
one run. It starts and stops its own Redis (:class:`~tools.redis_server.EmbeddedRedis`) and its own
workers; the results go to a JSON file and to ``docs/benchmarks.md`` with its plots.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.dispatch import measure_dispatch
from bench.limit import bare_latency_ms, bare_session, bare_throughput
from bench.load import closed_loop, open_loop
from bench.machine import machine_facts, tensorrt_available
from bench.peer import PeerUnavailable, PeerWorker, ensure_peer_venv
from bench.plan import WORKLOADS, Plan
from bench.procs import FleetConfig, RunningFleet, flush_redis, peak_rss_bytes
from bench.report import write_report
from bench.stats import summarize_run
from producer.client import FleetClient
from protocol.modelcard import load_card
from protocol.settings import load_settings
from tools.build_model import PRESETS
from tools.build_model import main as build_model_main
from tools.calibration import synthetic_sequences
from tools.quantize import QuantizationRefused, QuantizeConfig, quantize_model, report_path_for
from tools.redis_server import EmbeddedRedis

__all__ = ["run_bench"]

Say = Callable[[str], None]
Prompts = dict[str, list[list[int]]]


def _models(plan: Plan, work_dir: Path, say: Say) -> dict[str, Any]:
    """Build the preset's LM and identity model (when missing) and quantize the LM to INT8."""
    store = work_dir / "models"
    lm_spec, id_spec = PRESETS[plan.preset]["lm"], PRESETS[plan.preset]["identity"]
    fp32 = store / lm_spec["name"] / f"{lm_spec['name']}-1.0.0.onnx"
    identity = store / id_spec["name"] / f"{id_spec['name']}-1.0.0.onnx"
    for kind, path in (("lm", fp32), ("identity", identity)):
        if not path.exists():
            say(f"building the {plan.preset} {kind} model → {path}")
            build_model_main(["--preset", plan.preset, "--kind", kind, "--out-dir", str(store)])
    out: dict[str, Any] = {"fp32": str(fp32), "identity": str(identity), "variants": {}}
    variants = [("dynamic", QuantizeConfig(mode="dynamic", eval_count=32, overwrite=True))]
    if plan.int8_variants:
        variants += [
            ("static", QuantizeConfig(mode="static", calibration_count=32, eval_count=32, overwrite=True)),
            (
                "static-sym",
                QuantizeConfig(
                    mode="static", symmetric=True, calibration_count=32, eval_count=32, overwrite=True
                ),
            ),
        ]
    for name, cfg in variants:
        say(f"quantizing {fp32.name} ({name} INT8)")
        try:
            outcome = quantize_model(fp32, cfg, progress=False)
            out["variants"][name] = outcome.report
        except QuantizationRefused as exc:
            out["variants"][name] = exc.report
    dyn = out["variants"]["dynamic"]
    if not dyn.get("written"):
        raise RuntimeError(f"dynamic INT8 was refused by its gate: {dyn['gate']['failures']}")
    out["int8"] = dyn["output"]
    return out


def _limits(paths: dict[str, str], prompts: Prompts, plan: Plan, say: Say) -> dict[str, Any]:
    """Bare ``session.run`` throughput per batch size, and the lone-request bare latency."""
    out: dict[str, Any] = {}
    for variant in ("fp32", "int8"):
        path = Path(paths[variant])
        card = load_card(path)
        sess = bare_session(path)
        out[variant] = {}
        for wl, seqs in prompts.items():
            points = [
                bare_throughput(sess, card, seqs, b, duration_s=plan.limit_duration_s).__dict__
                for b in plan.limit_batch_sizes
            ]
            best = max(points, key=lambda p: float(p["qps"]))
            entry: dict[str, Any] = {
                "points": points,
                "best": best,
                "bare_lone_ms": bare_latency_ms(sess, card, seqs[: plan.lone_requests[wl]]),
            }
            if plan.ablations:
                spin = bare_session(path, spinning=True)
                entry["best_spinning"] = bare_throughput(
                    spin, card, seqs, int(best["batch_size"]), duration_s=plan.limit_duration_s
                ).__dict__
                del spin
            out[variant][wl] = entry
            say(
                f"limit {variant}/{wl}: best {best['qps']:.1f} req/s at batch {best['batch_size']}, "
                f"lone {entry['bare_lone_ms']:.1f} ms"
            )
        del sess
    return out


def _measure(
    client: FleetClient, model: str, prompts: Prompts, plan: Plan, say: Say, label: str
) -> dict[str, Any]:
    """Lone requests, closed-loop saturation and the open-loop sweep, for each workload."""
    out: dict[str, Any] = {}
    for wl, seqs in prompts.items():
        closed_loop(client, model, seqs, clients=plan.concurrency, max_requests=2 * plan.concurrency)  # warm
        lone = closed_loop(client, model, seqs, clients=1, max_requests=plan.lone_requests[wl])
        sat = closed_loop(
            client,
            model,
            seqs,
            clients=plan.concurrency,
            duration_s=plan.sat_duration_s[wl],
            warmup_s=plan.sat_warmup_s[wl],
        )
        sat_sum = summarize_run(sat.records, sat.window)
        entry: dict[str, Any] = {
            "lone": summarize_run(lone.records).as_dict(),
            "saturation": sat_sum.as_dict(),
            "open": [],
        }
        for i, frac in enumerate(plan.open_fractions):
            rate = max(0.5, frac * sat_sum.qps)
            recs = open_loop(
                client, model, seqs, rate_qps=rate, duration_s=plan.open_duration_s[wl], seed=plan.seed + i
            )
            entry["open"].append(
                {"fraction": frac, "offered_qps": rate, "summary": summarize_run(recs).as_dict()}
            )
        out[wl] = entry
        say(
            f"{label}/{wl}: {sat_sum.qps:.1f} req/s at saturation (p99 {sat_sum.latency.p99_ms:.0f} ms, "
            f"batch {sat_sum.mean_batch_size:.1f}), lone p50 {entry['lone']['latency']['p50_ms']:.1f} ms"
        )
    return out


def _fleet_row(
    cfg: FleetConfig, redis: EmbeddedRedis, work_dir: Path, prompts: Prompts, plan: Plan, say: Say
) -> dict[str, Any]:
    flush_redis(redis.url)
    fleet = RunningFleet(cfg, redis.url, work_dir)
    client = fleet.start()
    try:
        row: dict[str, Any] = {
            "status": "ok",
            "workloads": _measure(client, cfg.model_name, prompts, plan, say, cfg.label),
        }
        row["peak_rss_bytes"] = peak_rss_bytes(fleet.pid)
    finally:
        fleet.stop()
    return {
        **row,
        "label": cfg.label,
        "model_bytes": cfg.model_path.stat().st_size,
        "start_s": fleet.start_s,
        "max_batch_size": cfg.max_batch_size,
        "concurrency": cfg.concurrency,
    }


def _peer_row(
    cfg: FleetConfig,
    redis: EmbeddedRedis,
    work_dir: Path,
    prompts: Prompts,
    plan: Plan,
    peer_venv: Path,
    say: Say,
) -> dict[str, Any]:
    try:
        python, celery_version = ensure_peer_venv(peer_venv, progress=True)
    except PeerUnavailable as exc:
        say(f"peer: unavailable ({exc})")
        return {"status": f"unavailable: {exc}"}
    flush_redis(redis.url)
    settings = load_settings(cfg.write(work_dir / "configs", redis.url))
    worker = PeerWorker(
        python=python,
        model_path=cfg.model_path,
        queue=settings.queue_for(cfg.model_name),
        redis_url=redis.url,
        flush_every=cfg.max_batch_size,
        flush_interval_s=plan.peer_flush_interval_s,
        max_tokens=cfg.max_input_tokens,
        log_path=work_dir / "logs" / "peer.log",
    )
    started = time.monotonic()
    worker.start()
    client = FleetClient(settings)
    try:
        row: dict[str, Any] = {
            "status": "ok",
            "workloads": _measure(client, cfg.model_name, prompts, plan, say, "peer"),
        }
        row["peak_rss_bytes"] = peak_rss_bytes(worker.pid)
    finally:
        client.close()
        worker.stop()
    return {
        **row,
        "label": "peer",
        "model_bytes": cfg.model_path.stat().st_size,
        "start_s": time.monotonic() - started,
        "celery": celery_version,
        "max_batch_size": cfg.max_batch_size,
        "flush_interval_s": plan.peer_flush_interval_s,
    }


def _prompts(plan: Plan, vocab_size: int) -> Prompts:
    return {
        wl: synthetic_sequences(
            plan.prompts, vocab_size=vocab_size, min_tokens=lo, max_tokens=hi, seed=plan.seed + 100 + i
        )
        for i, (wl, (lo, hi)) in enumerate(WORKLOADS.items())
    }


def run_bench(plan: Plan, args: argparse.Namespace, command: str) -> dict[str, Any]:
    """Run every phase of ``plan``; write the JSON results and the Markdown report; return the results.

    ``args`` supplies ``work_dir``, ``out``, ``img_dir``, ``json_path`` and ``peer_venv``.
    """
    started = time.monotonic()
    work_dir = Path(args.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    steps = ["models", "limit", "baseline", "batching", "int8", "tensorrt", "peer", "dispatch", "report"]
    if plan.ablations:
        steps.insert(5, "spinning")
    bar = tqdm(total=len(steps), desc="bench", unit="phase", file=sys.stderr)

    def say(msg: str) -> None:
        bar.write(f"[bench] {msg}", file=sys.stderr)

    def step(name: str) -> None:
        bar.set_postfix_str(name)

    results: dict[str, Any] = {
        "meta": {
            "command": command,
            "quick": plan.quick,
            "plan": plan.__dict__,
            "machine": machine_facts(),
            "started_unix_s": time.time(),
        }
    }
    step("models")
    models = _models(plan, work_dir, say)
    results["models"] = models
    card = load_card(Path(models["fp32"]))
    results["meta"]["model"] = card.model_dump()
    prompts = _prompts(plan, card.vocab_size)
    bar.update()
    step("limit")
    results["limit"] = _limits({"fp32": models["fp32"], "int8": models["int8"]}, prompts, plan, say)
    bar.update()
    base = FleetConfig(
        label="batching",
        model_name=card.name,
        model_path=Path(models["fp32"]),
        max_batch_size=plan.max_batch_size,
        max_wait_ms=plan.max_wait_ms,
        concurrency=plan.concurrency,
        celery_loglevel="WARNING",
    )
    int8_card = load_card(Path(models["int8"]))
    configs = {
        "baseline": replace(base, label="baseline", max_batch_size=1),
        "batching": base,
        "int8": replace(base, label="int8", model_path=Path(models["int8"])),
    }
    if plan.ablations:
        configs["spinning"] = replace(base, label="spinning", engine_extra={"allow_spinning": True})
    rows: dict[str, Any] = {}
    with EmbeddedRedis() as redis:
        assert redis.proc is not None
        for name, cfg in configs.items():
            step(name)
            rows[name] = _fleet_row(cfg, redis, work_dir, prompts, plan, say)
            bar.update()
        step("tensorrt")
        if tensorrt_available():
            trt = replace(
                base,
                label="tensorrt",
                providers=("TensorrtExecutionProvider", "CPUExecutionProvider"),
                engine_extra={
                    "require_provider": "TensorrtExecutionProvider",
                    "trt_fp16": True,
                    "cache_dir": str((work_dir / "trt-cache").resolve()),
                },
            )
            rows["tensorrt"] = _fleet_row(trt, redis, work_dir, prompts, plan, say)
        else:
            rows["tensorrt"] = {
                "status": "needs a GPU",
                "providers": results["meta"]["machine"]["ort_providers"],
            }
            say("tensorrt: needs a GPU (no TensorRT EP / no GPU on this machine); row not measured")
        bar.update()
        step("peer")
        if plan.peer:
            rows["peer"] = _peer_row(base, redis, work_dir, prompts, plan, Path(args.peer_venv), say)
        else:
            rows["peer"] = {"status": "skipped (--quick)" if plan.quick else "skipped (--no-peer)"}
            say(f"peer: {rows['peer']['status']}")
        bar.update()
        step("dispatch")
        flush_redis(redis.url)
        ident = load_card(Path(models["identity"]))
        dispatch_cfg = replace(
            base,
            label="dispatch",
            model_name=ident.name,
            model_path=Path(models["identity"]),
            max_batch_size=plan.concurrency,
        )
        results["dispatch"] = measure_dispatch(
            dispatch_cfg,
            redis.url,
            redis.proc.pid,
            work_dir,
            prompts["short"],
            clients=plan.dispatch_clients,
            duration_s=plan.dispatch_duration_s,
            lone_requests=plan.dispatch_lone_requests,
            ablation_loglevel="INFO" if plan.ablations else None,
            profile_s=plan.profile_s,
            say=say,
        )
        bar.update()
    results["rows"] = rows
    results["meta"]["int8_version"] = int8_card.version
    results["meta"]["int8_report"] = str(report_path_for(Path(models["int8"])))
    results["meta"]["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    results["meta"]["duration_s"] = round(time.monotonic() - started, 1)
    step("report")
    json_path = Path(args.json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    write_report(results, Path(args.out), Path(args.img_dir))
    bar.update()
    bar.close()
    say(f"done in {results['meta']['duration_s']:.0f} s: {args.out}, {json_path}")
    return results
