"""What the generation figures say, in the run's own numbers (the report's reading of them).

Pure: takes ``results["generation"]`` and returns Markdown bullets, so a rerun rewrites the argument
with its own figures. The reasoning (which code copies the cache, and when) comes from reading
``workers/generation`` and is stated once here.
"""

from __future__ import annotations

import math
from typing import Any

from bench.markdown import fmt

__all__ = ["TARGET_RATIO", "generation_reading", "pct"]

TARGET_RATIO = 3.0
"""The issue's target: continuous batching ≥ 3× the tokens/s of one-at-a-time at saturation."""

ROW_KEYS = ("one_at_a_time", "static", "continuous")


def pct(x: Any) -> str:
    """A share in [0, 1] as a whole percentage ('–' when unknown)."""
    return "–" if x is None or math.isnan(float(x)) else f"{100 * float(x):.0f} %"


def _point(lim: dict[str, Any], batch_size: int) -> dict[str, Any]:
    return next((p for p in lim["points"] if int(p["batch_size"]) == batch_size), lim["best"])


def _ms_per_step(worker: dict[str, Any]) -> float:
    return 1000 * float(worker["step_s"]) / max(1.0, float(worker["steps"]))


def generation_reading(gen: dict[str, Any]) -> str:
    """Bullets: the target, what batching can give on this machine, where the continuous loop's time
    goes, the KV-cache copies, static vs continuous (empty when a fleet row is missing)."""
    rows, lim = gen["rows"], gen["limit"]
    if any(rows.get(k, {}).get("status") != "ok" for k in ROW_KEYS):
        return ""
    sat = {k: rows[k]["saturation"] for k in ROW_KEYS}
    one, stat, cont = (float(sat[k]["tokens_per_s"]) for k in ROW_KEYS)
    p99 = {k: fmt(s["ttft"]["p99_ms"], 0) for k, s in sat.items()}
    b = int(gen["plan"]["max_batch_size"])
    b1, bb, best = _point(lim, 1), _point(lim, b), lim["best"]
    lc, ls, prof = lim["loop"]["continuous"], lim["loop"]["static"], lim["profile"]
    wc, wo = sat["continuous"]["worker"], sat["one_at_a_time"]["worker"]
    copy = float(wc["copy_share"])
    ratio = cont / max(1e-9, one)
    bare = float(bb["tokens_per_s"]) / float(b1["tokens_per_s"])
    out = [
        f"- **Continuous batching makes {ratio:.2f}× the tokens/s of one at a time at saturation** ({fmt(cont)} vs "
        f"{fmt(one)}; static batching {stat / one:.2f}×), with TTFT p99 {p99['continuous']} ms against "
        f"{p99['one_at_a_time']} ms one at a time, where every request queues behind all earlier ones. The "
        f"{TARGET_RATIO:g}× target is " + ("met." if ratio >= TARGET_RATIO else "**not met**; what stops it:"),
        f"- **What batching itself gives on this CPU, prefill counted: {bare:.1f}× at batch {b}.** In the bare "
        f"loop (nobody leaves), a decode step of batch {b} makes {fmt(bb['decode_tokens_per_s'], 0)} tokens/s "
        f"against {fmt(b1['decode_tokens_per_s'], 0)} at batch 1 "
        f"({float(bb['decode_tokens_per_s']) / float(b1['decode_tokens_per_s']):.1f}×); with each batch's prefill "
        f"counted (prompts padded to the longest in the batch; the LM head runs at the last position only) it is "
        f"{bare:.1f}×, and "
        f"{float(best['tokens_per_s']) / float(b1['tokens_per_s']):.1f}× at the best batch ({best['batch_size']}).",
        f"- **The workers are compute-bound, not dispatch-bound**: the continuous worker's engine thread was busy "
        f"{pct(wc['busy_share'])} of its saturation runs, at {fmt(_ms_per_step(wc), 1)} ms per step for a mean batch "
        f"of {fmt(sat['continuous']['mean_batch'], 1)} rows (a bare decode step of {b} rows: "
        f"{fmt(bb['step_ms'], 1)} ms), against {fmt(_ms_per_step(wo), 1)} ms per step for one row one at a time "
        f"(bare: {fmt(b1['step_ms'], 1)} ms). A worker's step also carries the joiners' prefill"
        + ("" if gen.get("kv_in_place") else " and the cache re-layouts")
        + ", and shares the machine's cores with Celery, Redis, the stream publisher and the client.",
        f"- **Where a continuous step's time goes** (the worker's own `GenerationLoop` in process, "
        f"{fmt(lc['tokens_per_s'], 0)} tokens/s): prefill of joiners {pct(lc['shares']['prefill_share'])}, re-laying "
        f"out the KV cache when rows leave or join {pct(lc['shares']['copy_share'])} "
        f"({fmt(lc['shares']['copy_ms_per_relayout'], 1)} ms each, {fmt(lc['shares']['relayouts'], 0)} times in "
        f"{fmt(lc['shares']['steps'], 0)} steps), decode {pct(lc['shares']['decode_share'])}. The decode batch "
        f"averages {fmt(lc['shares']['mean_running'], 1)} of {b} rows (it drains as the last requests finish) and "
        f"{pct(lc['shares'].get('kv_fill'))} of its cache slots hold real tokens (rows are left-padded to the "
        "longest).",
        _kv_note(copy, cont, one, sat, lim, prof, in_place=bool(gen.get("kv_in_place"))),
        f"- **Static vs continuous**: static batching admits only into an empty batch, so a request that arrives "
        f"while a batch runs waits for the batch's longest member (TTFT p99 {p99['static']} ms static vs "
        f"{p99['continuous']} ms continuous); continuous admits at the next step, but each admission costs a prefill "
        + ("call. " if gen.get("kv_in_place") else "call and a re-layout of the whole running cache. ")
        + "At saturation it made "
        f"{cont / max(1e-9, stat):.2f}× static's tokens/s in the workers (in process: "
        f"{fmt(lc['tokens_per_s'], 0)} vs {fmt(ls['tokens_per_s'], 0)} tokens/s).",
    ]
    out += _under_load(rows)
    return "\n".join(out) + "\n"


def _kv_note(copy: float, cont: float, one: float, sat: dict[str, Any], lim: dict[str, Any],
             prof: dict[str, Any], *, in_place: bool) -> str:  # fmt: skip
    """What the KV cache costs the workers: nothing re-laid out when it is written in place, else the re-layouts."""
    concat = (f"`present = Concat(past, new)` is {pct(prof['concat_share'])} of ONNX Runtime's node time at batch "
              f"{prof['batch_size']} and {prof['past_tokens']} cached tokens")  # fmt: skip
    if in_place:
        return (f"- **The KV cache is written in place**: the workers copy no past ({pct(copy)} of their step time "
                "went to the cache's bookkeeping when rows left or joined; each sequence owns a slot of one "
                f"preallocated buffer, `engine.kv_cache`). In the export as built, {concat}: the copy of the whole "
                "past in every decode step that the worker's rewrite removes.")
    return (f"- **Copying the KV cache is the cost to remove.** In the workers the re-layouts took {pct(copy)} of the "
            f"continuous row's step time ({pct(sat['static']['worker']['copy_share'])} static); without them the "
            f"same steps would make about {fmt(cont / max(1e-9, 1 - copy), 0)} tokens/s, "
            f"{cont / max(1e-9, 1 - copy) / one:.1f}× one at a time (an estimate from the measured shares). One "
            f"re-layout moves the cache about {fmt(lim.get('relayout', {}).get('copies'), 1)} times over where one "
            f"copy would do (below). Inside every decode step the model copies it once more: {concat}.")


def _under_load(rows: dict[str, Any]) -> list[str]:
    """The highest offered load's TTFT p99 per row (continuous batching's other gain: latency)."""
    points = {k: rows[k].get("open") or [] for k in ROW_KEYS}
    if not all(points.values()):
        return []
    top = {k: p[-1] for k, p in points.items()}
    s = {k: p["summary"] for k, p in top.items()}
    return [
        f"- **Under offered load continuous batching keeps the first token fast**: at "
        f"{fmt(top['continuous']['offered_rps'], 2)} requests/s (Poisson) TTFT p99 is "
        f"{fmt(s['continuous']['ttft']['p99_ms'], 0)} ms continuous, {fmt(s['static']['ttft']['p99_ms'], 0)} ms static "
        f"and {fmt(s['one_at_a_time']['ttft']['p99_ms'], 0)} ms one at a time, at "
        f"{fmt(s['continuous']['tokens_per_s'], 0)} / {fmt(s['static']['tokens_per_s'], 0)} / "
        f"{fmt(s['one_at_a_time']['tokens_per_s'], 0)} tokens/s: a newcomer joins the running batch at the next "
        "step instead of waiting for a batch (or every earlier request) to finish."
    ]
