"""Prose of the report that depends on the run: the measuring protocol and the LM-head note."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["last_position_note", "method_notes", "reading_notes"]


def _limit_at(entry: dict[str, Any], batch_size: int) -> float:
    for point in entry["points"]:
        if int(point["batch_size"]) == batch_size:
            return float(point["qps"])
    return math.nan


def method_notes(plan: dict[str, Any]) -> str:
    """The measuring protocol, with this run's sizes."""
    sat, warm, lone = plan["sat_duration_s"], plan["sat_warmup_s"], plan["lone_requests"]
    return "\n".join(
        [
            f"- **Side by side.** Every configuration's worker (and the peer) runs at once on one Redis, each on its "
            f"own queue; the load visits them in turn, so background load on this shared machine spreads over all "
            f"rows instead of landing on one. Per workload: lone requests (1 client, the same {lone['long']} long / "
            f"{lone['short']} short prompts for everyone), then saturation in {plan['rounds']} interleaved windows "
            f"per configuration ({sat['long']:g} s long / {sat['short']:g} s short in all, each after a "
            f"{warm['long']:g} s / {warm['short']:g} s ramp that is not counted), then open-loop Poisson arrivals.",
            f"- **Saturation QPS** is Little's law for the closed loop: {plan['concurrency']} always-busy clients / "
            "mean latency, over every counted request (a plain count of completions in a few-second window jumps by a "
            "whole batch of 8 at each window edge; it is kept in the JSON as `qps_counted`).",
            "- **Latency** is `FleetClient.submit` → `FleetClient.result` returning. At saturation it includes "
            f"waiting behind the other {plan['concurrency'] - 1} clients' requests, so it is mostly queueing time; "
            "the low-load figures are the *1 client* lines of the latency tables.",
            "- **Mean batch** (requests per batch) and **padding efficiency** (real / padded tokens) come from "
            "each result's own timings; **worker peak RSS** is the worker process's `VmHWM` (it includes the "
            "warm-up at max_batch_size × max_input_tokens).",
            "- **The limit** is the best of two passes (before and after the fleet phase) per batch size, with the "
            "worker's session options; its *mean ms* is one `session.run` of the whole batch.",
            f"- **Rows as served**: `fleet.infer`, one Celery task per request, C = {plan['concurrency']}, "
            f"max_batch_size {plan['max_batch_size']} (1 for the baseline), max_wait_ms {plan['max_wait_ms']:g}, "
            "Celery log level WARNING. *Ablation* rows change one thing; *lean Celery* runs the same worker code "
            "through a measurement-only launcher (`bench/lean_worker.py`, no fleet code changed); the bulk rows of "
            "Dispatch cost go through the fleet's own `fleet.infer_bulk`.\n",
        ]
    )


def last_position_note(results: dict[str, Any]) -> str:
    """What computing the LM head at the last position only would gain (bare loop), if measured."""
    lim = results["limit"]
    if "fp32_last" not in lim:
        return ""
    b = int(results["meta"]["plan"]["max_batch_size"])
    gains = []
    for full, last in (("fp32", "fp32_last"), ("int8", "int8_last")):
        if last not in lim:
            continue
        for wl in lim[last]:
            for size in (1, b):
                before, after = _limit_at(lim[full][wl], size), _limit_at(lim[last][wl], size)
                if before > 0 and after > 0:
                    gains.append(f"{full.upper()} {wl} b={size}: {after / before:.2f}×")
    return (
        "*LM head at the last position* (`python -m tools.lm_head_last MODEL.onnx`, a separate model file): the "
        "graph gathers each row's last real position before the final MatMul, so `logits` is `[batch, 1, vocab]` "
        "instead of `[batch, seq, vocab]` (64 MiB of float32 for 8 x 256 tokens over 8,192 ids). Bare-loop "
        "throughput against the full model: " + "; ".join(gains) + ". The worker serves either shape "
        "(`workers/postprocess.last_positions` reads position `min(length, logits.shape[1]) - 1`); point a "
        "model's `path` at the rewritten file to use it.\n"
    )


def reading_notes(results: dict[str, Any]) -> str:
    """What the two tables say, in this run's figures (bullets; empty when a row is missing)."""
    rows, lim = results["rows"], results["limit"]
    b = int(results["meta"]["plan"]["max_batch_size"])
    if any(rows.get(k, {}).get("status") != "ok" for k in ("baseline", "batching", "int8")):
        return ""
    sat = {k: {wl: rows[k]["workloads"][wl]["saturation"] for wl in ("long", "short")} for k in rows
           if rows[k].get("status") == "ok"}  # fmt: skip
    out = []
    long_best = lim["fp32"]["long"]["best"]
    gain = ""
    if "fp32_last" in lim:
        g = _limit_at(lim["fp32_last"]["long"], b) / max(1e-9, _limit_at(lim["fp32"]["long"], b))
        gain = f"; computing the LM head at the last position only gives {g:.2f}× at batch {b} (below)"
    out.append(
        f"- **Long prompts are compute-bound, and batching their prefill does not pay on this CPU.** The bare loop "
        f"is fastest at batch {long_best['batch_size']} ({long_best['qps']:.1f} req/s vs "
        f"{_limit_at(lim['fp32']['long'], b):.1f} at batch {b}): a padded batch computes "
        f"{100 * (1 - sat['batching']['long']['padding_efficiency']):.0f} % padding and the full-vocabulary logits "
        f"of every position{gain}. Through the fleet, batching runs {sat['batching']['long']['qps']:.1f} req/s "
        f"against the baseline's {sat['baseline']['long']['qps']:.1f}; INT8 is the lever: "
        f"{sat['int8']['long']['qps'] / max(1e-9, sat['batching']['long']['qps']):.2f}× the FP32 batching row."
    )
    short_lim = _limit_at(lim["fp32"]["short"], b)
    d = results.get("dispatch") or {}
    cpu_ms = float((d.get("loop") or {}).get("cpu_ms_outside_inference", math.nan))
    rtt_ms = float(((d.get("lone") or {}).get("latency") or {}).get("p50_ms", math.nan))
    out.append(
        f"- **Short prompts are dispatch-bound.** Batching lifts the fleet from "
        f"{sat['baseline']['short']['qps']:.1f} to {sat['batching']['short']['qps']:.1f} req/s "
        f"(mean batch {sat['batching']['short']['mean_batch_size']:.1f}),"
        f" {100 * sat['batching']['short']['qps'] / max(1e-9, short_lim):.0f} % of the bare loop at batch {b}; the "
        f"rest is the {cpu_ms:.1f} CPU-ms every request costs in Celery, Redis and the client (see Dispatch cost). "
        "The same cost keeps INT8 at "
        f"{sat['int8']['short']['qps'] / max(1e-9, sat['batching']['short']['qps']):.2f}× FP32 through the fleet "
        f"against {_limit_at(lim['int8']['short'], b) / max(1e-9, short_lim):.2f}× bare, and a lone request "
        f"about one empty round trip ({rtt_ms:.1f} ms p50) above a bare `session.run`."
    )
    if "peer" in sat:
        out.append(
            f"- **The peer** batches in its 50 ms flush window: a lone request waits it out "
            f"({rows['peer']['workloads']['short']['lone']['latency']['p50_ms']:.0f} ms p50 for a short prompt vs "
            f"{rows['batching']['workloads']['short']['lone']['latency']['p50_ms']:.0f} ms for the fleet), but each "
            "message costs it less than a full Celery task; under saturation it carries "
            f"{sat['peer']['short']['qps']:.1f} short req/s to the fleet's {sat['batching']['short']['qps']:.1f}. "
            "The lean-Celery row (per-task extras off) and the bulk path in Dispatch cost show the fleet's "
            "way past it."
        )
    return "\n".join(out) + "\n"
