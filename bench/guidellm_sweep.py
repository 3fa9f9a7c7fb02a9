"""The guidellm rows: vLLM's own load client sweeping the gateway, unchanged.

``fleet bench --only guidellm`` serves the preset's LM (with a byte vocabulary, :data:`BYTE_VOCAB`) with one
worker behind a gateway (``fleet api``)
on a private redis-server, and runs guidellm 0.8.1 (``var/guidellm-venv``, the venv of the
``tests/guidellm`` tier: built on first use) against ``/v1/completions`` with its ``sweep`` profile:
a synchronous run, a throughput run (every request at once: saturation), then constant request rates
evenly between the two. Each request has a synthetic ``prompt_tokens`` prompt (counted by guidellm's
tokenizer, a small byte-level BPE: ``tools/guidellm_tokenizer.py``) and ``output_tokens`` forced new
tokens (guidellm sends ``ignore_eos``), streamed with ``continuous_usage_stats``. guidellm's JSON
report gives, per run: requests/s, output tokens/s, TTFT and inter-token latency (ms).
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.standalone import built, say, write_page
from tools.tier_venvs import TIERS, build_tier

ROOT = Path(__file__).resolve().parents[1]
VENV = TIERS["guidellm"].venv
PINS = TIERS["guidellm"].pins
"""The tier's pins (``tests/guidellm``): one venv serves both."""

__all__ = ["PINS", "QUICK", "VENV", "GuidellmPlan", "byte_vocab_model", "ensure_venv", "guidellm_body",
           "measure_guidellm", "render_guidellm", "run_guidellm_only", "summarize"]


@dataclass(frozen=True)
class GuidellmPlan:
    """Sizes of the guidellm rows."""

    prompt_tokens: int = 64
    output_tokens: int = 32
    sweep_size: int = 6
    seconds: float = 20.0


BYTE_VOCAB = 259
"""pad, bos, eos and the 256 bytes: a random model's tokens then decode to text (ASCII half the time), where
the preset's 8,192-token vocabulary yields mostly ids with no text, whose chunks an OpenAI stream leaves out
(guidellm would time the whole reply as one chunk)."""
QUICK = GuidellmPlan(prompt_tokens=16, output_tokens=8, sweep_size=3, seconds=3.0)


def ensure_venv() -> Path:
    """``var/guidellm-venv`` (the tests' tier, :data:`tools.tier_venvs.TIERS`; built when missing, a few minutes).

    Raises:
        RuntimeError: pip could not install the pins (offline, no CPU torch wheel on the machine).
    """
    build_tier(TIERS["guidellm"])
    return VENV


def _stat(metric: dict[str, Any], key: str) -> float:
    value = metric.get("successful", metric).get(key)
    return float(value) if isinstance(value, int | float) else float("nan")


def _percentile(metric: dict[str, Any], name: str) -> float:
    percentiles = metric.get("successful", metric).get("percentiles", {})
    value = percentiles.get(name)
    return float(value) if isinstance(value, int | float) else float("nan")


def summarize(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per run of guidellm's JSON report: strategy, rate, req/s, tokens/s, TTFT and ITL (ms)."""
    rows = []
    for bench in report["benchmarks"]:
        metrics = bench["metrics"]
        strategy = bench.get("config", {}).get("strategy", bench.get("scheduler", {}).get("strategy", {}))
        totals = metrics["request_totals"]
        rows.append({
            "strategy": strategy.get("type_", strategy.get("type", "?")) if isinstance(strategy, dict) else "?",
            "rate": strategy.get("rate") if isinstance(strategy, dict) else None,
            "requests": totals["successful"],
            "errored": totals["errored"],
            "cut": totals.get("incomplete", 0),
            "requests_per_s": _stat(metrics["requests_per_second"], "mean"),
            "output_tokens_per_s": _stat(metrics["output_tokens_per_second"], "mean"),
            "ttft_p50_ms": _stat(metrics["time_to_first_token_ms"], "median"),
            "ttft_p99_ms": _percentile(metrics["time_to_first_token_ms"], "p99"),
            "itl_p50_ms": _stat(metrics["inter_token_latency_ms"], "median"),
            "itl_p99_ms": _percentile(metrics["inter_token_latency_ms"], "p99"),
        })
    return rows


def measure_guidellm(plan: GuidellmPlan, model: Path, work_dir: Path, say: Callable[[str], None]) -> dict[str, Any]:
    """The sweep through a real gateway + worker (see the module docstring), JSON-friendly."""
    from bench.procs import FleetConfig, RunningFleet
    from bench.redis_cost import GatewayServer
    from protocol.modelcard import load_card
    from tools.redis_server import EmbeddedRedis

    work_dir, model = work_dir.absolute(), model.absolute()  # guidellm runs in work_dir: no relative paths
    python = ensure_venv() / "bin" / "python"
    tokenizer = work_dir / "guidellm-tokenizer"
    subprocess.run([str(python), str(ROOT / "tools" / "guidellm_tokenizer.py"), str(tokenizer)], check=True,
                   capture_output=True, timeout=300)  # fmt: skip
    card = load_card(model)
    config = FleetConfig(label="guidellm", model_name=card.name, model_path=model, max_batch_size=16, concurrency=32,
                         celery_loglevel="WARNING", max_input_tokens=512, max_new_tokens=max(64, plan.output_tokens))
    out = work_dir / "guidellm.json"
    with EmbeddedRedis() as redis:
        fleet = RunningFleet(config, redis.url, work_dir)
        fleet.start()
        gateway = GatewayServer(fleet.config_path, work_dir / "logs" / "guidellm-gateway.log")
        try:
            gateway.wait_ready()
            cmd = [
                str(VENV / "bin" / "guidellm"), "run",
                "--backend", f"kind=openai_http,target={gateway.url},request_format=/v1/completions",
                "--profile", f"kind=sweep,sweep_size={plan.sweep_size}",
                "--constraint", f"kind=max_duration,seconds={plan.seconds}",
                "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
                "--data", f"kind=synthetic_text,prompt_tokens={plan.prompt_tokens},output_tokens={plan.output_tokens}",
                "--output", f"kind=json,path={out}",
                "--disable-progress",
            ]  # fmt: skip
            say(f"guidellm sweep ({plan.sweep_size} runs of {plan.seconds:.0f} s) against {gateway.url}")
            env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                   "PATH": "/usr/bin:/bin"}
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=work_dir,
                                  timeout=120 + plan.sweep_size * (plan.seconds + 60))  # fmt: skip
            if proc.returncode != 0:
                raise RuntimeError(f"guidellm failed ({proc.returncode}): {(proc.stdout + proc.stderr)[-4000:]}")
        finally:
            gateway.stop()
            fleet.stop()
    report = json.loads(out.read_text())
    return {"model": card.name, "plan": plan.__dict__, "rows": summarize(report), "guidellm": PINS[1],
            "route": "/v1/completions"}


def guidellm_body(results: dict[str, Any]) -> list[str]:
    """What the sweep measured and how: the table, the saturation line and the method (no heading, no stamp)."""
    plan = results["plan"]
    lines = [
        f"{results['guidellm']} (`guidellm run`, profile `sweep`, {plan['seconds']:.0f} s per run), unchanged, "
        f"against `{results['route']}` of a gateway and one worker serving `{results['model']}` (C = 32, "
        f"`max_batch_size` 16) on the same 2 cores; prompts of {plan['prompt_tokens']} guidellm tokens, "
        f"{plan['output_tokens']} new tokens each (forced), streamed.",
        "",
        "| run | rate (req/s) | requests | errors | in flight at the run's end | req/s | output tokens/s | "
        "TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        rate = f"{row['rate']:.2f}" if isinstance(row["rate"], int | float) else "—"
        lines.append(f"| {row['strategy']} | {rate} | {row['requests']} | {row['errored']} | {row['cut']} | "
                     f"{row['requests_per_s']:.2f} | {row['output_tokens_per_s']:.0f} | {row['ttft_p50_ms']:.0f} | "
                     f"{row['ttft_p99_ms']:.0f} | {row['itl_p50_ms']:.1f} | {row['itl_p99_ms']:.1f} |")
    saturation = next((r for r in results["rows"] if r["strategy"] == "throughput"), None)
    if saturation is not None:
        lines += ["", f"Throughput at saturation: **{saturation['requests_per_s']:.2f} req/s**, "
                      f"{saturation['output_tokens_per_s']:.0f} output tokens/s."]
    lines += [
        "",
        "How it is measured: `bench/guidellm_sweep.py`; the rates of the constant runs are guidellm's own choice "
        "between the synchronous and the throughput run (which keeps 512 requests in flight). TTFT and ITL are "
        "guidellm's, from the streamed chunks. A stream's first token is written at once; later ones reach the "
        "gateway in bursts every `worker.stream_window_ms` (25 ms), each `XREAD` returning every entry written "
        "since the last, so ITL mixes near-zero gaps inside a burst with the burst interval. The model is the "
        "preset's with a byte vocabulary (random weights: most tokens add text, so each is its own chunk). "
        "Requests in flight when a run's time is up are counted apart (guidellm's `incomplete`), not as errors.",
        "",
    ]
    return lines


def render_guidellm(results: dict[str, Any]) -> str:
    """The Markdown page of a :func:`measure_guidellm` result (with its ``meta``)."""
    meta = results.get("meta", {})
    stamp = (f"From one `{meta.get('command', 'fleet bench --only guidellm')}` run at commit "
             f"`{meta.get('commit', '?')}`{' (uncommitted changes)' if meta.get('dirty') else ''}, "
             f"{meta.get('machine', '')}, {meta.get('duration_s', 0):.0f} s.")  # fmt: skip
    body = guidellm_body(results)
    return "\n".join(["# guidellm against the gateway", "", f"{stamp} {body[0]}", *body[1:]])


def byte_vocab_model(preset: str, work_dir: Path) -> Path:
    """The ``preset``'s LM with a :data:`BYTE_VOCAB`-token vocabulary (built into ``work_dir/models`` once)."""
    from tools.build_lm import build_causal_lm
    from tools.build_model import PRESETS

    spec = {k: v for k, v in PRESETS[preset]["lm"].items() if k not in ("name", "vocab_size")}
    name = f"{PRESETS[preset]['lm']['name']}-bytes"
    # byte ids only: most generated tokens add text, so each one is its own chunk
    return built(work_dir / "models" / name / f"{name}-1.0.0.onnx",
                 f"{name} (the {preset} LM with a {BYTE_VOCAB}-token byte vocabulary)",
                 lambda: build_causal_lm(work_dir / "models", name=name, vocab_size=BYTE_VOCAB, **spec))


def run_guidellm_only(quick: bool, preset: str, out_dir: Path, work_dir: Path, command: str,
                      machine: Callable[[], dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    """``fleet bench --only guidellm``: build the preset's LM with a byte vocabulary if needed, run the sweep,
    write ``guidellm.md`` and ``guidellm.json`` in ``out_dir``."""
    model = byte_vocab_model(preset, work_dir)
    facts, started = machine(), time.time()
    results = measure_guidellm(QUICK if quick else GuidellmPlan(), model, work_dir, say)
    return write_page("guidellm", results, render_guidellm, out_dir, command=command, facts=facts,
                      started_unix_s=started)  # fmt: skip
