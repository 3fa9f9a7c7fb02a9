"""The same-weights rows: the fleet against a bare loop and onnxruntime-genai, one Llama exported two ways.

``fleet bench --only same-weights`` builds, per size of :data:`SameWeightsPlan.sizes`, one random Llama
(``tools/build_llama.py``: Hugging Face's layout, GQA, RoPE, SwiGLU), then writes the same weights as a
Hugging Face checkpoint and exports them with onnxruntime-genai's model builder (``bench/og_tier.py``,
run in the ``genai`` tier's venv: ``tools/tier_venvs.py``). The same requests then go, in interleaved
rounds (the order rotates each round), to:

* **fleet** — FleetClient → Redis → a ``celery worker`` subprocess with continuous batching
  (``max_batch_size`` rows, C = ``max_batch_size``), all submitted at once;
* **OpenAI SDK, streaming** — the official ``openai`` client against the gateway (``fleet api``) in
  front of the same worker: ``/v1/completions`` with the prompt's token ids, ``stream=True``,
  ``ignore_eos``, one thread per request, all at once; its tokens are counted from ``usage`` (a stream
  carries text);
* **worker's loop, in process** — the worker's own :class:`~workers.generation.loop.GenerationLoop` on the
  worker's engine (its session options, the rewritten graph, the in-place cache) in this process, with
  no Celery, no Redis and no stream: what the fleet's queue and transport cost is the gap to the fleet;
* **bare continuous** — :func:`bench.bare_loop.bare_generate` on the fleet's export as is (numpy +
  ONNX Runtime with its default session options, none of the worker's code), ``max_batch_size`` rows;
* **bare one at a time** — the same loop, one request at a time;
* **og.Engine** — onnxruntime-genai's engine on the builder's export (its CPU engine batches
  statically, up to ``max_batch_size``).

Every request is greedy with a forced length (``ignore_eos``; og: min = max generated tokens); the
tokens of every row must equal the fleet's (counted, not assumed). Figures: output tokens/s (all
tokens / first submit → last token), time to first token (the fleet's is the worker's own figure,
submit → first token; the loops' and og's, start → first token), and each ratio per round, whose
median and range the page reports. Nothing asserts a speed.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from bench.bare_loop import bare_generate
from bench.genlimit import load_engine, loop_run
from bench.genstats import parse_metrics
from bench.load import scheduled
from bench.procs import FleetConfig, RunningFleet
from bench.redis_cost import GatewayServer
from bench.same_weights_md import render_same_weights, same_weights_body
from bench.same_weights_plan import QUICK, ROWS, TEXT_ONLY, LlamaSize, SameWeightsPlan
from bench.standalone import built, say, write_page
from producer.client import FleetClient
from protocol.errors import FleetError
from protocol.messages import InferenceResult
from protocol.modelcard import load_card
from tools.redis_server import free_port
from tools.tier_venvs import TIERS, build_tier
from workers.engine import Engine

__all__ = ["QUICK", "LlamaSize", "SameWeightsPlan", "measure_same_weights", "render_same_weights",
           "run_same_weights_only", "same_weights_body"]

OG_SCRIPT = Path(__file__).with_name("og_tier.py")

Work = list[tuple[list[int], int]]
Row = dict[str, Any]
"""One row's round: ``tokens_per_s``, ``span_s``, ``ttft_ms`` (per request) and ``tokens`` (per request)."""


def workload(plan: SameWeightsPlan, vocab_size: int) -> Work:
    """``plan.requests`` seeded (prompt, max_new_tokens) pairs; ids from 3 up (no pad, BOS or EOS)."""
    rng = np.random.default_rng(plan.seed)
    out = []
    for _ in range(plan.requests):
        length = int(rng.integers(plan.prompt_tokens[0], plan.prompt_tokens[1] + 1))
        prompt = rng.integers(3, vocab_size, size=length).tolist()
        out.append((prompt, int(rng.integers(plan.new_tokens[0], plan.new_tokens[1] + 1))))
    return out


def _row(tokens: list[list[int]] | None, ttft_ms: list[float], span_s: float, counts: list[int] | None = None) -> Row:
    """A round of one row; ``counts`` (tokens per request) only where ``tokens`` are not known."""
    counts = [len(t) for t in tokens] if tokens is not None else counts or []
    return {"tokens_per_s": sum(counts) / span_s, "span_s": span_s, "ttft_ms": ttft_ms, "tokens": tokens,
            "counts": counts}


def _fleet_round(fleet: RunningFleet, client: FleetClient, work: Work) -> Row:
    model = fleet.config.model_name

    def submit(n: int) -> str:
        prompt, new = work[n]
        return client.submit(model, prompt, generation={"max_new_tokens": new, "temperature": 0, "ignore_eos": True})

    def record(n: int, submitted: float, done: float, out: InferenceResult | FleetError) -> tuple[float, float, Any]:
        if not isinstance(out, InferenceResult) or out.generation is None:
            raise RuntimeError(f"fleet request {n} failed: {out}")
        return submitted, done, out.generation

    records = scheduled(client, [0.0] * len(work), submit, record)
    span = max(done for _, done, _ in records) - min(sub for sub, _, _ in records)
    return _row([list(g.token_ids) for _, _, g in records],
                [g.timings.time_to_first_token_ms for _, _, g in records], span)  # fmt: skip


def _sdk_round(sdk: Any, model: str, work: Work) -> Row:
    """One burst through ``sdk`` (an ``openai.OpenAI`` client kept across rounds, as the FleetClient is:
    its connections stay open, as a user's would)."""
    started = time.perf_counter()

    def one(n: int) -> tuple[float, float, int]:
        prompt, new = work[n]
        first, count = float("nan"), 0
        stream = sdk.completions.create(model=model, prompt=prompt, max_tokens=new, temperature=0, stream=True,
                                        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        for chunk in stream:
            if chunk.choices and math.isnan(first):
                first = time.perf_counter() - started
            if chunk.usage is not None:
                count = chunk.usage.completion_tokens
        return first, time.perf_counter() - started, count

    with ThreadPoolExecutor(len(work)) as pool:
        done = list(pool.map(one, range(len(work))))
    return _row(None, [first * 1000 for first, _, _ in done], max(end for _, end, _ in done),
                counts=[count for _, _, count in done])


def _loop_round(engine: Engine, work: Work, max_batch: int) -> Row:
    run = loop_run(engine, work, max_batch_size=max_batch, continuous=True)
    return _row(run["token_ids"], run["ttft_ms"], run["seconds"])


def _bare_round(session: ort.InferenceSession, work: Work, max_batch: int) -> Row:
    requests, span = bare_generate(session, work, max_batch)
    return _row([r.tokens for r in requests], [r.first_s * 1000 for r in requests], span)


def _og_round(python: Path, og_dir: Path, work: Work, scratch: Path) -> Row:
    (scratch / "work.json").write_text(json.dumps(work))
    done = subprocess.run([str(python), str(OG_SCRIPT), "run", str(og_dir), str(scratch / "work.json"),
                           str(scratch / "og.json")], capture_output=True, text=True, timeout=600)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"og.Engine run failed (exit {done.returncode}): {done.stderr[-2000:]}")
    out = json.loads((scratch / "og.json").read_text())
    row = _row([r["tokens"] for r in out["requests"]], [r["first_s"] * 1000 for r in out["requests"]], out["span_s"])
    row["og"] = {"capabilities": out["capabilities"], "versions": out["versions"]}
    return row


def _export_og(python: Path, model: Path, size: LlamaSize, plan: SameWeightsPlan, out: Path) -> Path:
    """onnxruntime-genai's export of ``model``'s weights (built once per size and batch)."""
    og_dir = out / "og"
    if not (og_dir / "genai_config.json").exists():
        say(f"exporting {size.name} with onnxruntime-genai's builder → {og_dir}")
        out.mkdir(parents=True, exist_ok=True)
        (out / "hf_config.json").write_text(json.dumps(size.hf_config()))
        cmd = [str(python), str(OG_SCRIPT), "export", str(model), str(out / "hf_config.json"), str(out),
               str(plan.max_batch_size)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"onnxruntime-genai export failed (exit {done.returncode}): {done.stderr[-3000:]}")
    return og_dir


def _kv_in_place(port: int) -> bool | None:
    """The worker's ``fleet_worker_kv_in_place`` gauge (None when it does not export one)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    if "\nfleet_worker_kv_in_place" not in f"\n{text}":
        return None
    return parse_metrics(text, ["fleet_worker_kv_in_place"])["fleet_worker_kv_in_place"] == 1.0


def _mismatches(reference: list[list[int]], other: list[list[int]]) -> int:
    """Requests whose tokens differ from the reference's."""
    return sum(a != b for a, b in zip(reference, other, strict=True))


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _summarize(rounds: list[dict[str, Row]]) -> dict[str, Any]:
    """Per row: tokens/s (median, range), TTFT p50/p99 over every round's requests, token mismatches with
    the fleet; per ratio fleet / other: median and range of the per-round ratios."""
    rows: dict[str, dict[str, Any]] = {}
    for name in ROWS:
        ttft = [t for r in rounds for t in r[name]["ttft_ms"]]
        compared = name not in TEXT_ONLY
        rows[name] = {"tokens_per_s": _spread([r[name]["tokens_per_s"] for r in rounds]),
                      "ttft_ms": {"p50": float(np.percentile(ttft, 50)), "p99": float(np.percentile(ttft, 99))},
                      "mismatched_requests": sum(_mismatches(r["fleet"]["tokens"], r[name]["tokens"])
                                                 for r in rounds) if compared else None,
                      "miscounted_requests": sum(a != b for r in rounds
                                                 for a, b in zip(r["fleet"]["counts"], r[name]["counts"], strict=True)),
                      "tokens": sum(rounds[0][name]["counts"])}  # fmt: skip
    ratios = {other: _spread([r["fleet"]["tokens_per_s"] / r[other]["tokens_per_s"] for r in rounds])
              for other in ROWS[1:] if other not in TEXT_ONLY}  # fmt: skip
    ratios |= {f"{sdk} / fleet": _spread([r[sdk]["tokens_per_s"] / r["fleet"]["tokens_per_s"] for r in rounds])
               for sdk in TEXT_ONLY}  # fmt: skip
    ttft_p99 = {"fleet": rows["fleet"]["ttft_ms"]["p99"], "bare continuous": rows["bare continuous"]["ttft_ms"]["p99"]}
    return {"rows": rows, "ratios": ratios, "ttft_p99_ratio": ttft_p99["fleet"] / ttft_p99["bare continuous"],
            "og": rounds[0]["og.Engine"].get("og", {})}  # fmt: skip


def measure_size(plan: SameWeightsPlan, size: LlamaSize, model: Path, og_python: Path, redis_url: str,
                 work_dir: Path) -> dict[str, Any]:  # fmt: skip
    """Every row of one size in ``plan.rounds`` interleaved rounds (after one warm round, not counted)."""
    og_dir = _export_og(og_python, model, size, plan, work_dir / "og-exports" / f"{size.name}-b{plan.max_batch_size}")
    work = workload(plan, size.vocab_size)
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    engine = load_engine(model, load_card(model), plan.max_batch_size)
    cfg = FleetConfig(label=f"same-weights-{size.name}", model_name=size.name, model_path=model,
                      max_batch_size=plan.max_batch_size, concurrency=plan.max_batch_size,
                      max_input_tokens=plan.prompt_tokens[1], max_new_tokens=plan.new_tokens[1],
                      celery_loglevel="WARNING", metrics_port=free_port())  # fmt: skip
    fleet = RunningFleet(cfg, redis_url, work_dir)
    fleet.spawn()
    gateway = GatewayServer(fleet.config_path, work_dir / "logs" / f"same-weights-{size.name}-gateway.log")
    from openai import OpenAI

    sdk = OpenAI(base_url=f"{gateway.url}/v1", api_key="unused-on-loopback", max_retries=0, timeout=600)
    try:
        client = fleet.ready()
        gateway.wait_ready()
        runs: dict[str, Callable[[], Row]] = {
            "fleet": lambda: _fleet_round(fleet, client, work),
            "OpenAI SDK, streaming": lambda: _sdk_round(sdk, size.name, work),
            "worker's loop, in process": lambda: _loop_round(engine, work, plan.max_batch_size),
            "bare continuous": lambda: _bare_round(session, work, plan.max_batch_size),
            "bare one at a time": lambda: _bare_round(session, work, 1),
            "og.Engine": lambda: _og_round(og_python, og_dir, work, og_dir.parent),
        }
        for run in runs.values():  # warm: allocations, first shapes, the worker's first steps
            run()
        in_place = _kv_in_place(cfg.metrics_port)
        rounds = []
        for r in range(plan.rounds):
            order = ROWS[r % len(ROWS):] + ROWS[: r % len(ROWS)]
            rounds.append({name: runs[name]() for name in order})
            say(f"{size.name} round {r + 1}/{plan.rounds}: " + ", ".join(
                f"{name} {rounds[-1][name]['tokens_per_s']:.0f} tok/s" for name in ROWS))  # fmt: skip
    finally:
        sdk.close()
        gateway.stop()
        fleet.stop()
    summary = _summarize(rounds)
    summary.update(size=asdict(size), parameters=size.parameters, kv_in_place=in_place,
                   per_round={name: [round(r[name]["tokens_per_s"], 1) for r in rounds] for name in ROWS},
                   workload={"requests": len(work), "prompt_tokens": sum(len(p) for p, _ in work),
                             "new_tokens": sum(n for _, n in work)})  # fmt: skip
    return summary


def _build(size: LlamaSize, store: Path) -> Path:
    from tools.build_llama import build_llama

    return build_llama(store, name=size.name, num_layers=size.num_layers, hidden_size=size.hidden_size,
                       num_heads=size.num_heads, num_kv_heads=size.num_kv_heads, vocab_size=size.vocab_size,
                       max_positions=size.max_positions)  # fmt: skip


def measure_same_weights(plan: SameWeightsPlan, redis_url: str, work_dir: Path) -> dict[str, Any]:
    """Every size of ``plan`` (builds the models and the genai tier's venv when missing)."""
    og_python = build_tier(TIERS["genai"])
    sizes = []
    for size in plan.sizes:
        model = built(work_dir / "models" / size.name / f"{size.name}-1.0.0.onnx", size.name,
                      partial(_build, size, work_dir / "models"))
        sizes.append(measure_size(plan, size, model, og_python, redis_url, work_dir))
    return {"plan": {k: v for k, v in asdict(plan).items() if k != "sizes"}, "sizes": sizes,
            "genai_tier": list(TIERS["genai"].pins), "onnxruntime": ort.__version__}  # fmt: skip


def run_same_weights_only(quick: bool, preset: str, out_dir: Path, work_dir: Path, command: str,
                          machine: Callable[[], dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    """``fleet bench --only same-weights``: the models are the page's own (whatever the ``preset``); writes
    ``same-weights.md`` and ``same-weights.json`` in ``out_dir``."""
    from tools.redis_server import EmbeddedRedis

    facts, started = machine(), time.time()
    with EmbeddedRedis() as server:
        results = measure_same_weights(QUICK if quick else SameWeightsPlan(), server.url, work_dir)
    return write_page("same-weights", results, render_same_weights, out_dir, command=command, facts=facts,
                      started_unix_s=started)  # fmt: skip
