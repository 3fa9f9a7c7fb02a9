"""The KV-cache rows: the graph's ``Concat`` cache against the in-place cache, side by side in one run.

``fleet bench --only kvcache`` loads one LM twice in this process (``engine.kv_cache: concat`` and
``in_place``; the preset's LM with ``max_positions`` 1024, so a past of 512 fits) and measures, in
interleaved rounds:

* **decode step time against the past**: ``batch`` rows holding a past of 64 and of 512 tokens, the
  median of ``steps`` decode steps each; the slope is the added ms per 100 tokens of past. On the
  Concat cache every step copies every row's whole past into the new ``present`` (the bytes are
  counted); in place the step writes one column per row;
* **the continuous-batching loop** (:class:`~workers.generation.loop.GenerationLoop`, as the worker
  drives it): ``requests`` arriving together (prompts 10–64 tokens, 19–63 new tokens, greedy with
  forced lengths), ``max_batch_size`` rows: tokens/s, time to first token, the share of step time
  spent re-laying out the cache, and KV bytes copied per generated token. Tokens must be identical.

Reported as ratios of the in-place row to the Concat row measured in the same round; nothing asserts
a speed. Writes ``kvcache.md`` and ``kvcache.json`` beside ``--out``.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.standalone import built, say, write_page
from protocol.messages import GenerationParams
from protocol.modelcard import load_card
from protocol.settings import BatchingSettings, EngineSettings, LimitSettings
from workers.engine import Engine
from workers.generation.batch_kv import ConcatKV, SlotKV
from workers.generation.inplace_check import open_decoder
from workers.generation.loop import GenerationLoop, GenStepStats
from workers.generation.sequence import GenSequence

__all__ = ["KVPlan", "measure_kvcache", "render_kvcache", "run_kvcache_only"]

KINDS = ("concat", "in_place")


@dataclass(frozen=True)
class KVPlan:
    """Sizes of the kvcache rows."""

    batch: int = 16
    pasts: tuple[int, int] = (64, 512)
    steps: int = 16
    requests: int = 16
    max_batch_size: int = 16
    rounds: int = 3
    max_positions: int = 1024


QUICK = KVPlan(batch=4, pasts=(16, 96), steps=4, requests=6, max_batch_size=4, rounds=1, max_positions=256)


def _engine(path: Path, kind: str, max_batch_size: int) -> Engine:
    settings = EngineSettings(providers=["CPUExecutionProvider"], kv_cache=kind)  # type: ignore[arg-type]
    return Engine(path, load_card(path), settings, BatchingSettings(max_batch_size=max_batch_size),
                  LimitSettings(max_input_tokens=load_card(path).max_positions))  # fmt: skip


def decode_step_ms(loop: GenerationLoop, batch: int, past: int, steps: int, seed: int) -> dict[str, float]:
    """``batch`` rows of ``past`` prompt tokens prefilled, then ``steps`` decode steps: median ms per step and
    KV bytes copied per step (the loop's own cache, either kind)."""
    rng = random.Random(seed)
    vocab = loop.decoder.engine.card.vocab_size
    seqs = [GenSequence(request_id=f"r{i}", prompt=[rng.randrange(3, vocab) for _ in range(past)], eos_ids=frozenset(),
                        params=GenerationParams(max_new_tokens=steps + 2, temperature=0.0, ignore_eos=True,
                                                stream=False))
            for i in range(batch)]  # fmt: skip
    times: list[float] = []
    copied: list[int] = []

    def observe(stats: GenStepStats) -> None:
        if stats.running == batch and stats.joined == 0 and stats.prefill_ms == 0:
            times.append(stats.decode_ms)
            copied.append(stats.kv_copied_bytes)

    loop.observers.append(observe)
    try:
        loop.step(seqs)
        while loop.has_work():
            loop.step([])
    finally:
        loop.observers.remove(observe)
    return {"step_ms": statistics.median(times), "copied_bytes_per_step": statistics.median(copied),
            "steps": len(times)}  # fmt: skip


def loop_burst(loop: GenerationLoop, work: list[tuple[list[int], int]]) -> dict[str, Any]:
    """Every request of ``work`` submitted at once, served until all end: tokens/s, TTFT, copy share."""
    steps: list[GenStepStats] = []
    loop.observers.append(steps.append)
    started = time.monotonic()
    waiting = [GenSequence(request_id=str(i), prompt=list(p), arrived_s=started, eos_ids=frozenset(),
                           params=GenerationParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, stream=False))
               for i, (p, n) in enumerate(work)]  # fmt: skip
    pending = list(waiting)
    try:
        while pending or loop.has_work():
            count = loop.admissible(pending)
            joiners, pending = pending[:count], pending[count:]
            loop.step(joiners)
    finally:
        loop.observers.remove(steps.append)
    elapsed = time.monotonic() - started
    tokens = [s.future.result().token_ids for s in waiting]
    ttft = sorted(x for s in steps for x in s.first_token_ms)
    step_ms = sum(s.prefill_ms + s.copy_ms + s.decode_ms for s in steps)
    generated = sum(len(t) for t in tokens)
    return {
        "tokens": tokens,
        "tokens_per_s": generated / elapsed,
        "ttft_p50_ms": float(np.percentile(ttft, 50)),
        "ttft_p99_ms": float(np.percentile(ttft, 99)),
        "copy_share": sum(s.copy_ms for s in steps) / step_ms if step_ms else 0.0,
        "copied_bytes_per_token": sum(s.kv_copied_bytes for s in steps) / generated,
    }


def measure_kvcache(plan: KVPlan, model: Path, say: Callable[[str], None]) -> dict[str, Any]:
    """Every figure of the kvcache rows (see the module docstring), JSON-friendly."""
    loops = {}
    for kind in KINDS:
        engine = _engine(model, kind, plan.max_batch_size)
        batching = BatchingSettings(max_batch_size=max(plan.batch, plan.max_batch_size), prefix_cache_bytes=0,
                                    max_batch_tokens=plan.max_batch_size * max(plan.pasts), prefill_chunk_tokens=0)
        loops[kind] = GenerationLoop(open_decoder(engine), batching)
        if loops[kind].kv.in_place != (kind == "in_place"):
            raise RuntimeError(f"{model.name}: kv_cache {kind} opened {type(loops[kind].kv).__name__}")
    vocab = load_card(model).vocab_size
    rng = random.Random(17)
    work = [([rng.randrange(3, vocab) for _ in range(rng.randint(10, 64))], rng.randint(19, 63))
            for _ in range(plan.requests)]
    slope: dict[str, dict[int, list[dict[str, float]]]] = {k: {p: [] for p in plan.pasts} for k in KINDS}
    bursts: dict[str, list[dict[str, Any]]] = {k: [] for k in KINDS}
    for round_ in range(plan.rounds):
        for kind in KINDS if round_ % 2 == 0 else KINDS[::-1]:
            for past in plan.pasts:
                slope[kind][past].append(decode_step_ms(loops[kind], plan.batch, past, plan.steps, seed=round_))
            bursts[kind].append(loop_burst(loops[kind], work))
            say(f"round {round_ + 1}/{plan.rounds} {kind}: step "
                + ", ".join(f"past {p} {slope[kind][p][-1]['step_ms']:.2f} ms" for p in plan.pasts)
                + f"; burst {bursts[kind][-1]['tokens_per_s']:.0f} tokens/s")
    same = all(b["tokens"] == bursts["concat"][0]["tokens"] for k in KINDS for b in bursts[k])
    low, high = plan.pasts
    rows: dict[str, Any] = {}
    for kind in KINDS:
        at = {p: statistics.median(r["step_ms"] for r in slope[kind][p]) for p in plan.pasts}
        rows[kind] = {
            "step_ms": {str(p): at[p] for p in plan.pasts},
            "slope_ms_per_100_past": (at[high] - at[low]) * 100 / (high - low),
            "copied_mib_per_step": {str(p): slope[kind][p][0]["copied_bytes_per_step"] / 2**20 for p in plan.pasts},
            "burst": {key: statistics.median(b[key] for b in bursts[kind])
                      for key in ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "copy_share",
                                  "copied_bytes_per_token")},
            "burst_tokens_per_s_rounds": [round(b["tokens_per_s"], 1) for b in bursts[kind]],
        }
    ratios = [i["tokens_per_s"] / c["tokens_per_s"] for i, c in zip(bursts["in_place"], bursts["concat"], strict=True)]
    card = load_card(model)
    return {
        "model": {"name": card.name, "layers": card.num_layers, "heads": card.num_heads, "kv_heads": card.kv_heads,
                  "head_dim": card.head_dim, "max_positions": card.max_positions},
        "plan": plan.__dict__,
        "rows": rows,
        "burst_ratio_rounds": [round(r, 3) for r in ratios],
        "burst_ratio": statistics.median(ratios),
        "same_tokens": same,
        "slot_cache_mib": loops["in_place"].kv.cache.nbytes / 2**20 if isinstance(loops["in_place"].kv, SlotKV)
        else 0.0,
        "concat_is_concat": isinstance(loops["concat"].kv, ConcatKV),
    }


def render_kvcache(results: dict[str, Any]) -> str:
    """The Markdown page of a :func:`measure_kvcache` result (with its ``meta``)."""
    plan, meta, rows, m = results["plan"], results.get("meta", {}), results["rows"], results["model"]
    low, high = plan["pasts"]
    lines = [
        "# KV cache: the graph's Concat cache against the in-place cache",
        "",
        f"From one `{meta.get('command', 'fleet bench --only kvcache')}` run at commit `{meta.get('commit', '?')}`"
        f"{' (uncommitted changes)' if meta.get('dirty') else ''}, {meta.get('machine', '')}, "
        f"{meta.get('duration_s', 0):.0f} s. Model: `{m['name']}` ({m['layers']} layers, {m['heads']} heads of "
        f"{m['head_dim']}, {m['kv_heads']} KV heads, `max_positions` {m['max_positions']}), one process, CPU provider, "
        f"{plan['rounds']} interleaved rounds (medians).",
        "",
        f"## Decode step time against the past (batch {plan['batch']})",
        "",
        f"| cache | step at past {low} (ms) | step at past {high} (ms) | slope (ms per 100 tokens of past) | "
        f"KV copied per step at past {high} (MiB) |",
        "|---|---|---|---|---|",
    ]
    for kind, row in rows.items():
        lines.append(f"| {kind} | {row['step_ms'][str(low)]:.2f} | {row['step_ms'][str(high)]:.2f} | "
                     f"{row['slope_ms_per_100_past']:.3f} | {row['copied_mib_per_step'][str(high)]:.1f} |")
    c, i = rows["concat"], rows["in_place"]
    lines += [
        "",
        f"In place / Concat at past {high}: **{i['step_ms'][str(high)] / c['step_ms'][str(high)]:.2f}×** the step "
        f"time; slope {i['slope_ms_per_100_past'] / c['slope_ms_per_100_past']:.2f}× the Concat slope.",
        "",
        f"## Continuous batching: {plan['requests']} requests arriving together (`max_batch_size` "
        f"{plan['max_batch_size']})",
        "",
        "| cache | tokens/s | TTFT p50 (ms) | TTFT p99 (ms) | membership-change share of step time | "
        "KV bytes copied per generated token |",
        "|---|---|---|---|---|---|",
    ]
    for kind, row in rows.items():
        b = row["burst"]
        lines.append(f"| {kind} | {b['tokens_per_s']:.0f} | {b['ttft_p50_ms']:.1f} | {b['ttft_p99_ms']:.1f} | "
                     f"{b['copy_share']:.1%} | {b['copied_bytes_per_token']:,.0f} |")
    lines += [
        "",
        f"In place / Concat tokens/s: **{results['burst_ratio']:.2f}×** (per round: "
        f"{', '.join(f'{r:.2f}' for r in results['burst_ratio_rounds'])}). Tokens identical in every round and "
        f"both caches: **{'yes' if results['same_tokens'] else 'no'}**.",
        "",
        "How it is measured: `bench/kvcache.py`. The Concat cache copies, every decode step, each row's whole "
        "past into the new `present` (rows × cache width), and re-lays the batch out whenever a sequence "
        "joins or leaves; the in-place cache (`engine.kv_cache`, `tools/inplace_kv.py`) is one preallocated "
        f"buffer of {results['slot_cache_mib']:.0f} MiB (`max_batch_size` slots × `max_positions`) that "
        "`GroupQueryAttention` writes at each row's own column: it copies no KV at all here (the prefix cache, "
        "off in these rows, is the only thing that copies into or out of a slot).",
        "",
    ]
    return "\n".join(lines)


def run_kvcache_only(quick: bool, preset: str, out_dir: Path, work_dir: Path, command: str,
                     machine: Callable[[], dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    """``fleet bench --only kvcache``: build the preset's LM with a longer ``max_positions``, run the rows,
    write ``kvcache.md`` and ``kvcache.json`` in ``out_dir``."""
    from tools.build_lm import build_causal_lm
    from tools.build_model import PRESETS

    plan = QUICK if quick else KVPlan()
    spec = {k: v for k, v in PRESETS[preset]["lm"].items() if k not in ("name", "max_positions")}
    name = f"{PRESETS[preset]['lm']['name']}-{plan.max_positions}"
    model = built(work_dir / "models" / name / f"{name}-1.0.0.onnx", f"{name} (max_positions {plan.max_positions})",
                  lambda: build_causal_lm(work_dir / "models", name=name, max_positions=plan.max_positions, **spec))
    facts, started = machine(), time.time()
    results = measure_kvcache(plan, model, say)
    return write_page("kvcache", results, render_kvcache, out_dir, command=command, facts=facts, started_unix_s=started)
