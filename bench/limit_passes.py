"""The bench's limit: bare ``session.run`` throughput per batch size and workload, measured in passes before and
after the fleet configurations (:mod:`bench.runner`), and merged pass by pass (the better figure is kept).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.limit import bare_latency_ms, bare_session, bare_throughput
from bench.machine import provider_chain_for
from bench.plan import Plan
from protocol.modelcard import load_card

__all__ = ["Prompts", "limit_pass", "merge_limits"]

Say = Callable[[str], None]
Prompts = dict[str, list[list[int]]]
"""Prompts (token ids) per workload of :data:`bench.plan.WORKLOADS`."""


def limit_pass(paths: dict[str, str], prompts: Prompts, plan: Plan) -> dict[str, Any]:
    """One pass of bare ``session.run`` throughput per batch size, plus the lone-request latency."""
    out: dict[str, Any] = {}
    for variant, path_str in paths.items():
        path = Path(path_str)
        card = load_card(path)
        providers = provider_chain_for(plan.provider)
        sess = bare_session(path, providers=providers, max_batch_size=max(plan.limit_batch_sizes))
        out[variant] = {}
        sizes = plan.limit_batch_sizes if variant in ("fp32", "int8") else (1, plan.max_batch_size)
        for wl, seqs in prompts.items():
            points = [
                bare_throughput(sess, card, seqs, b, duration_s=plan.limit_duration_s, min_runs=2).__dict__
                for b in sizes
            ]
            entry: dict[str, Any] = {
                "points": points,
                "bare_lone_ms": bare_latency_ms(sess, card, seqs[: plan.lone_requests[wl]]),
                "providers_active": sess.get_providers(),
            }
            if plan.ablations and variant in ("fp32", "int8"):
                best_b = int(max(points, key=lambda p: float(p["qps"]))["batch_size"])
                spin = bare_session(path, spinning=True, providers=providers,
                                    max_batch_size=max(plan.limit_batch_sizes))
                entry["best_spinning"] = bare_throughput(
                    spin, card, seqs, best_b, duration_s=plan.limit_duration_s, min_runs=2
                ).__dict__
                del spin
            out[variant][wl] = entry
        del sess
    return out


def merge_limits(passes: list[dict[str, Any]], say: Say) -> dict[str, Any]:
    """Best QPS per batch size over the passes (background load only ever lowers a ceiling)."""
    out: dict[str, Any] = {}
    for variant, by_wl in passes[0].items():
        out[variant] = {}
        for wl in by_wl:
            entries = [p[variant][wl] for p in passes]
            points = [
                max((e["points"][i] for e in entries), key=lambda pt: float(pt["qps"]))
                for i in range(len(entries[0]["points"]))
            ]
            merged: dict[str, Any] = {
                "points": points,
                "best": max(points, key=lambda pt: float(pt["qps"])),
                "bare_lone_ms": min(float(e["bare_lone_ms"]) for e in entries),
                "passes": [[round(float(pt["qps"]), 2) for pt in e["points"]] for e in entries],
                "providers_active": entries[0].get("providers_active"),
            }
            spins = [e["best_spinning"] for e in entries if "best_spinning" in e]
            if spins:
                merged["best_spinning"] = max(spins, key=lambda pt: float(pt["qps"]))
            out[variant][wl] = merged
            say(
                f"limit {variant}/{wl}: best {merged['best']['qps']:.1f} req/s at batch "
                f"{merged['best']['batch_size']}, lone {merged['bare_lone_ms']:.1f} ms"
            )
    return out
