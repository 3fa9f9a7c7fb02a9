"""The bench run: models → the limit → every configuration of the table → dispatch cost → generation → the
same weights against a bare loop and og.Engine → guidellm's sweep → report.

Everything runs on the same machine in one run, so ratios are measured side by side: the fleet
configurations and the peer are served at once and visited in interleaved rounds (see
:mod:`bench.rounds`), and the limit is measured before and after them (the better pass is kept).
It starts and stops its own Redis (:class:`~tools.redis_server.EmbeddedRedis`) and its own workers;
the results go to a JSON file and to ``docs/benchmarks.md`` with its plots.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.dispatch import dispatch_variants, measure_dispatch
from bench.dispatch_only import probe_gateway_and_lone
from bench.generation import measure_generation
from bench.guidellm_sweep import GuidellmPlan, byte_vocab_model, measure_guidellm
from bench.limit_passes import Prompts, limit_pass, merge_limits
from bench.machine import machine_facts, provider_chain_for, provider_unavailable
from bench.peer import PeerUnavailable, ensure_peer_venv
from bench.plan import WORKLOADS, Plan
from bench.procs import FleetConfig, flush_redis
from bench.report import write_report
from bench.rounds import Server, measure_servers, start_fleet_servers, start_peer_server
from bench.same_weights import SameWeightsPlan, measure_same_weights
from protocol.modelcard import load_card
from tools.build_model import PRESETS
from tools.build_model import main as build_model_main
from tools.calibration import synthetic_sequences
from tools.lm_head_last import write_last_variant
from tools.quantize import QuantizationRefused, QuantizeConfig, quantize_model, report_path_for
from tools.redis_server import EmbeddedRedis
from tools.tier_venvs import IndexUnreachable, TierBuildFailed

__all__ = ["build_models", "run_bench", "run_generation_only"]

Say = Callable[[str], None]


def build_models(plan: Plan, work_dir: Path, say: Say) -> dict[str, Any]:
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
                QuantizeConfig(mode="static", symmetric=True, calibration_count=32, eval_count=32, overwrite=True),
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
    if plan.ablations:  # the LM-head-at-last-position variants (tools/lm_head_last.py), bare loop only
        last = write_last_variant(fp32)
        out["fp32_last"] = str(last)
        say(f"quantizing {last.name} (dynamic INT8)")
        out["int8_last"] = str(
            quantize_model(last, QuantizeConfig(mode="dynamic", eval_count=16, overwrite=True), progress=False).path
        )
    return out


def _prompts(plan: Plan, vocab_size: int) -> Prompts:
    return {
        wl: synthetic_sequences(
            plan.prompts, vocab_size=vocab_size, min_tokens=lo, max_tokens=hi, seed=plan.seed + 100 + i
        )
        for i, (wl, (lo, hi)) in enumerate(WORKLOADS.items())
    }


def _configs(plan: Plan, name: str, models: dict[str, Any], work_dir: Path) -> dict[str, FleetConfig]:
    """The table's fleet configurations; each gets its own model key (so its own queue)."""
    chain = provider_chain_for(plan.provider)
    base = FleetConfig(
        label="batching",
        model_name=f"{name}-batching",
        model_path=Path(models["fp32"]),
        max_batch_size=plan.max_batch_size,
        max_wait_ms=plan.max_wait_ms,
        concurrency=plan.concurrency,
        celery_loglevel="WARNING",
        providers=chain,
        # a GPU run that silently lands on CPU would measure the wrong thing: the worker refuses instead
        engine_extra={"require_provider": chain[0]} if plan.provider != "cpu" else {},
    )
    configs = {
        "baseline": replace(base, label="baseline", model_name=f"{name}-baseline", max_batch_size=1),
        "batching": base,
        "int8": replace(base, label="int8", model_name=f"{name}-int8", model_path=Path(models["int8"])),
    }
    if plan.ablations:
        configs["lean"] = replace(base, label="lean", model_name=f"{name}-lean", lean=True)
        configs["spinning"] = replace(
            base, label="spinning", model_name=f"{name}-spinning",
            engine_extra={**base.engine_extra, "allow_spinning": True},
        )
    if plan.provider != "tensorrt" and provider_unavailable("tensorrt") is None:
        configs["tensorrt"] = replace(
            base,
            label="tensorrt",
            model_name=f"{name}-tensorrt",
            providers=("TensorrtExecutionProvider", "CPUExecutionProvider"),
            engine_extra={
                **base.engine_extra,
                "require_provider": "TensorrtExecutionProvider",
                "trt_fp16": True,
                "cache_dir": str((work_dir / "trt-cache").resolve()),
            },
        )
    return configs


def tensorrt_row_status(plan: Plan) -> dict[str, str]:
    """The TensorRT row when it is not measured: the real reason (libraries, device, build), or that the
    whole run is TensorRT (``--provider tensorrt``: every row already runs it)."""
    if plan.provider == "tensorrt":
        return {"status": "every row runs TensorRT (--provider tensorrt)"}
    reason = provider_unavailable("tensorrt")
    return {"status": f"not run: {reason}" if reason else "not run: its worker did not start"}


def _serve_and_measure(
    plan: Plan, args: argparse.Namespace, configs: dict[str, FleetConfig], redis_url: str, prompts: Prompts, say: Say
) -> dict[str, Any]:
    """Start every configuration (and the peer), measure them interleaved, stop them."""
    work_dir = Path(args.work_dir)
    peer_status: str | None = None
    peer_env: tuple[Path, str] | None = None
    if not plan.peer:
        peer_status = "skipped (--quick)" if plan.quick else "skipped (--no-peer)"
    else:
        try:
            peer_env = ensure_peer_venv(Path(args.peer_venv), progress=True)
        except PeerUnavailable as exc:
            peer_status = f"unavailable: {exc}"
    if peer_status:
        say(f"peer: {peer_status}")
    say(f"starting {len(configs) + (peer_env is not None)} workers: {', '.join(configs)}{', peer' if peer_env else ''}")
    servers: dict[str, Server] = {}
    tensorrt_failure: dict[str, str] | None = None
    try:
        required = {k: c for k, c in configs.items() if k != "tensorrt"}
        servers.update(start_fleet_servers(required, redis_url, work_dir))
        if "tensorrt" in configs:  # an optional row: a worker that cannot start is a row, not a failed phase
            try:
                servers.update(start_fleet_servers({"tensorrt": configs["tensorrt"]}, redis_url, work_dir))
            except (RuntimeError, TimeoutError) as exc:
                lines = [ln for ln in str(exc).splitlines() if ln.strip()]
                last = lines[-1][:300] if lines else str(exc)
                tensorrt_failure = {"status": f"not run: its worker did not start ({last})"}
        if peer_env is not None:
            peer_cfg = replace(
                configs["batching"],
                label="peer",
                model_name=configs["batching"].model_name.replace("-batching", "-peer"),
            )
            servers["peer"] = start_peer_server(peer_cfg, peer_env[0], peer_env[1], redis_url, work_dir, plan)
        rows = measure_servers(servers, prompts, plan, say)
    finally:
        for server in servers.values():
            server.stop()
    if peer_status:
        rows["peer"] = {"status": peer_status}
    if "tensorrt" not in rows:
        rows["tensorrt"] = tensorrt_failure or tensorrt_row_status(plan)
        say(f"tensorrt: {rows['tensorrt']['status']}; row not measured")
    return rows


def _generation(plan: Plan, model: Path, redis_url: str, work_dir: Path, command: str, say: Say) -> dict[str, Any]:
    """The generation phase, stamped with the run it came from (it can be rerun alone)."""
    started = time.time()
    machine = machine_facts()
    out = measure_generation(plan.generation, model, redis_url, work_dir, max_wait_ms=plan.max_wait_ms,
                             seed=plan.seed, say=say, providers=provider_chain_for(plan.provider))  # fmt: skip
    out["meta"] = {
        "command": command, "commit": machine["git_commit"], "dirty": machine["git_dirty"], "started_unix_s": started,
        "load_average_start": machine["load_average_start"], "load_average_end": [round(x, 2) for x in os.getloadavg()],
    }  # fmt: skip
    return out


def _same_weights(plan: Plan, redis_url: str, work_dir: Path) -> dict[str, Any]:
    """The same-weights rows, or why they did not run (``--quick``; no package index for the genai tier)."""
    if not plan.same_weights:
        return {"status": "skipped (--quick)"}
    try:
        return {"status": "ok", **measure_same_weights(SameWeightsPlan(), redis_url, work_dir)}
    except (IndexUnreachable, TierBuildFailed) as exc:
        return {"status": f"not run: the genai tier could not be built ({exc})"}
    except Exception as exc:  # the phases before keep their figures; the report says why
        return {"status": f"failed: {type(exc).__name__}: {exc}"}


def _guidellm(plan: Plan, work_dir: Path, say: Say) -> dict[str, Any]:
    """guidellm's sweep (its own Redis, worker and gateway), or why it did not run."""
    if not plan.guidellm:
        return {"status": "skipped (--quick)"}
    try:
        model = byte_vocab_model(plan.preset, work_dir)
        return {"status": "ok", **measure_guidellm(GuidellmPlan(), model, work_dir, say)}
    except (IndexUnreachable, TierBuildFailed) as exc:
        return {"status": f"not run: the guidellm tier could not be built ({exc})"}
    except Exception as exc:  # the phases before keep their figures; the report says why
        return {"status": f"failed: {type(exc).__name__}: {exc}"}


def run_generation_only(plan: Plan, args: argparse.Namespace, command: str) -> dict[str, Any]:
    """Rerun only the generation phase: its figures replace ``generation`` in the ``args.json_path``
    results of an earlier run, and the report is rewritten from them.

    Raises:
        FileNotFoundError: there are no earlier results to merge into.
    """
    json_path = Path(args.json_path)
    results: dict[str, Any] = json.loads(json_path.read_text())
    work_dir = Path(args.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    spec = PRESETS[plan.preset]["lm"]
    model = work_dir / "models" / spec["name"] / f"{spec['name']}-1.0.0.onnx"

    def say(msg: str) -> None:
        print(f"[bench] {msg}", file=sys.stderr)

    if not model.exists():
        say(f"building the {plan.preset} lm model → {model}")
        build_model_main(["--preset", plan.preset, "--kind", "lm", "--out-dir", str(work_dir / "models")])
    with EmbeddedRedis() as redis:
        results["generation"] = _generation(plan, model, redis.url, work_dir, command, say)
    json_path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    write_report(results, Path(args.out), Path(args.img_dir))
    say(f"generation done in {results['generation']['duration_s']:.0f} s: {args.out}, {json_path}")
    return results


def run_bench(plan: Plan, args: argparse.Namespace, command: str) -> dict[str, Any]:
    """Run every phase of ``plan``; write the JSON results and the Markdown report; return the results.

    ``args`` supplies ``work_dir``, ``out``, ``img_dir``, ``json_path`` and ``peer_venv``.
    """
    started = time.monotonic()
    work_dir = Path(args.work_dir)
    shutil.rmtree(work_dir / "logs", ignore_errors=True)  # worker logs of this run only
    work_dir.mkdir(parents=True, exist_ok=True)
    steps = ["models", "limit (before)", "fleet + peer", "limit (after)", "dispatch", "generation", "same weights",
             "guidellm", "report"]  # fmt: skip
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
    models = build_models(plan, work_dir, say)
    results["models"] = models
    card = load_card(Path(models["fp32"]))
    results["meta"]["model"] = card.model_dump()
    results["meta"]["int8_version"] = load_card(Path(models["int8"])).version
    results["meta"]["int8_report"] = str(report_path_for(Path(models["int8"])))
    prompts = _prompts(plan, card.vocab_size)
    bar.update()
    paths: dict[str, str] = {k: models[k] for k in ("fp32", "int8", "fp32_last", "int8_last") if k in models}
    step("limit (before)")
    passes = [limit_pass(paths, prompts, plan)]
    bar.update()
    with EmbeddedRedis() as redis:
        assert redis.proc is not None
        step("fleet + peer")
        results["rows"] = _serve_and_measure(
            plan, args, _configs(plan, card.name, models, work_dir), redis.url, prompts, say
        )
        bar.update()
        step("limit (after)")
        passes.append(limit_pass(paths, prompts, plan))
        results["limit"] = merge_limits(passes, say)
        bar.update()
        step("dispatch")
        flush_redis(redis.url)
        ident_path = Path(models["identity"])
        variants = dispatch_variants(plan, load_card(ident_path).name, ident_path)
        results["dispatch"] = measure_dispatch(
            variants, redis.url, redis.proc.pid, work_dir,
            prompts["short"], clients=plan.dispatch_clients, duration_s=plan.dispatch_duration_s,
            lone_requests=plan.dispatch_lone_requests, rounds=plan.rounds, profile_s=plan.profile_s, say=say,
            floors=(True, False),
        )  # fmt: skip
        # the gateway's loop and the lone-request profile, as `fleet bench --only dispatch` measures them
        results["dispatch"].update(probe_gateway_and_lone(
            plan, ident_path, variants["served"][1], redis, work_dir, prompts["short"], say))
        bar.update()
        step("generation")
        results["generation"] = _generation(plan, Path(models["fp32"]), redis.url, work_dir, command, say)
        bar.update()
        step("same weights")
        flush_redis(redis.url)
        results["same_weights"] = _same_weights(plan, redis.url, work_dir)
        bar.update()
    step("guidellm")
    results["guidellm"] = _guidellm(plan, work_dir, say)
    bar.update()
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
