"""Decode steps as CUDA graphs against the same steps launched kernel by kernel, side by side.

Three decoders over the in-place cache the worker would serve for the model on the chosen chain, each
on its own session, run the same script in alternating rounds: ``rows`` prompts prefilled into the
slots, then ``steps`` greedy decode steps over all of them, each step timed from the call to its
logits in host memory (ids, mask and positions bound, the run, the logits read back):

- **ordinary steps**: the mask as wide as the longest row, inputs bound from host arrays at each step;
- **fixed steps**: the shapes and addresses a graph replays (a capacity-wide mask, inputs written into
  buffers made once per span), run kernel by kernel: the cost of the fixed shapes alone;
- **CUDA graphs**: fixed steps captured once per span and replayed (``engine.cuda_graph``); only on a
  chain with the CUDA provider, otherwise the row says why it did not run.

Every variant must give the same tokens (``same_tokens``); the ratios are against ordinary steps, from
the median step of all rounds.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["measure_decode_graphs"]

VARIANTS = ("ordinary steps", "fixed steps", "CUDA graphs")


def _script(decoder: Any, prompts: list[list[int]], steps: int) -> tuple[list[float], list[list[int]]]:
    """Prefill ``prompts`` into a fresh cache, then ``steps`` greedy steps; (ms per step, tokens per row)."""
    cache = decoder.new_cache(len(prompts))
    slots = cache.take(len(prompts))
    logits, _ms, _padded = decoder.prefill_first(cache, slots, prompts)
    tokens = {slot: int(t) for slot, t in zip(slots, np.argmax(logits, axis=1), strict=True)}
    out = [[t] for t in tokens.values()]
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        logits, _ms = decoder.decode_slots(cache, tokens)
        times.append((time.perf_counter() - started) * 1000)
        tokens = {slot: int(np.argmax(logits[slot])) for slot in tokens}
        for slot, t in tokens.items():
            out[slot].append(t)
    return times, out


def measure_decode_graphs(model_path: Path, choice: str, *, rows: int = 8, steps: int = 32, rounds: int = 5,
                          prompt_tokens: tuple[int, int] = (16, 48)) -> dict[str, Any]:  # fmt: skip
    """The three variants of the module docstring on ``choice``'s chain; ``{"skipped": reason}`` when that chain
    keeps the Concat cache for ``model_path`` (a float32 graph on a GPU: the FP16 graph is the one to measure).

    Raises:
        ValueError: ``rows``, ``steps`` or ``rounds`` < 1.
    """
    from bench.genlimit import load_engine
    from bench.machine import provider_chain_for
    from protocol.modelcard import load_card
    from tools.calibration import synthetic_sequences
    from workers.generation.inplace_check import open_decoder
    from workers.generation.inplace_decoder import InPlaceDecoder

    if min(rows, steps, rounds) < 1:
        raise ValueError(f"rows, steps and rounds must be ≥ 1 (got {rows}, {steps}, {rounds})")
    card = load_card(model_path)
    chain = provider_chain_for(choice)
    lo, hi = prompt_tokens
    prompts = [list(p) for p in synthetic_sequences(rows, vocab_size=card.vocab_size, min_tokens=lo, max_tokens=hi,
                                                    seed=11)]  # fmt: skip
    decoders: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for variant in VARIANTS:
        engine = load_engine(model_path, card, rows, chain, cuda_graph=variant == "CUDA graphs")
        decoder = open_decoder(engine) if engine.kv.in_place else None
        if not isinstance(decoder, InPlaceDecoder):
            return {"skipped": engine.kv.reason or "the in-place probe disagreed", "providers": list(engine.providers)}
        if variant == "CUDA graphs" and not decoder.replays_graphs:
            skipped[variant] = engine.cuda_graph_reason or "the session does not capture graphs"
            continue
        decoder.fixed_steps = variant != "ordinary steps"
        decoders[variant] = decoder
    times: dict[str, list[float]] = {v: [] for v in decoders}
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(rounds):
        for variant, decoder in decoders.items():
            ms, out = _script(decoder, prompts, steps)
            times[variant] += ms[1:]  # a span's first step makes its buffers (and captures its graph)
            tokens.setdefault(variant, out)
    base = statistics.median(times["ordinary steps"])
    table: dict[str, dict[str, Any]] = {}
    for variant in VARIANTS:
        if variant in skipped:
            table[variant] = {"status": "not run", "reason": skipped[variant]}
            continue
        median = statistics.median(times[variant])
        table[variant] = {"status": "ok", "step_ms_p50": round(median, 4),
                          "step_ms_p90": round(float(np.percentile(times[variant], 90)), 4),
                          "tokens_per_s": round(rows * 1000 / median, 1), "vs_ordinary": round(base / median, 3)}
    engine = decoders["ordinary steps"].engine
    return {"providers": list(engine.providers), "rows": rows, "steps": steps, "rounds": rounds,
            "prompt_tokens": f"{lo}–{hi}", "capacity": card.max_positions, "variants": table,
            "same_tokens": all(t == tokens["ordinary steps"] for t in tokens.values())}
