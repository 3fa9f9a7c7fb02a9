"""The report's reasoning: targets checked against the run's figures, and the dispatch-cost analysis.

Targets are measured and reported here, never asserted in tests.
"""

from __future__ import annotations

import math
from typing import Any

from bench.findings import dispatch_findings
from bench.genreport import generation_target

__all__ = ["dispatch_section", "target_rows", "targets_section"]


def _f(x: float, digits: int = 1) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.{digits}f}"


def _limit_at(entry: dict[str, Any], b: int) -> float:
    for p in entry["points"]:
        if int(p["batch_size"]) == b:
            return float(p["qps"])
    return float("nan")


def _ok(row: dict[str, Any] | None) -> bool:
    return bool(row) and row.get("status") == "ok"  # type: ignore[union-attr]


def _sat(row: dict[str, Any], wl: str) -> dict[str, Any]:
    sat: dict[str, Any] = row["workloads"][wl]["saturation"]
    return sat


def target_rows(results: dict[str, Any]) -> list[list[str]]:
    """[target, workload, measured, met?] for every target the issue sets."""
    rows: list[list[str]] = []
    b = int(results["meta"]["plan"]["max_batch_size"])
    r = results["rows"]
    for wl in ("long", "short"):
        lim = results["limit"]["fp32"][wl]
        if _ok(r.get("batching")):
            sat = _sat(r["batching"], wl)
            same = _limit_at(lim, b)
            ratio = sat["qps"] / same if same > 0 else float("nan")
            best = float(lim["best"]["qps"])
            rows.append(
                [
                    f"batching ≥ 95 % of the limit at batch {b}",
                    wl,
                    f"{ratio:.0%} ({_f(sat['qps'])} vs {_f(same)} req/s; {sat['qps'] / best:.0%} of the best "
                    f"bare batch {lim['best']['batch_size']})",
                    _met(ratio >= 0.95),
                ]
            )
            lone_run = r["batching"]["workloads"][wl]["lone"]
            lone = lone_run["latency"]["p50_ms"]
            gap = lone - float(lim["bare_lone_ms"])
            split = ""
            if math.isfinite(lone_run.get("engine_p50_ms", math.nan)):  # runs before the split was recorded
                split = (f"; in the worker: submit → batch start {_f(lone_run['queue_wait_p50_ms'], 2)} ms, "
                         f"engine {_f(lone_run['engine_p50_ms'], 2)} ms")  # fmt: skip
            rows.append(
                [
                    "lone request p50 within 5 ms of one bare session.run",
                    wl,
                    f"+{_f(gap, 2)} ms ({_f(lone, 2)} vs {_f(lim['bare_lone_ms'], 2)} ms{split})",
                    _met(gap <= 5.0),
                ]
            )
        if _ok(r.get("batching")) and _ok(r.get("peer")):
            ours, peer = _sat(r["batching"], wl), _sat(r["peer"], wl)
            q = ours["qps"] / peer["qps"] if peer["qps"] > 0 else float("nan")
            p99_ok = ours["latency"]["p99_ms"] <= peer["latency"]["p99_ms"]
            rows.append(
                [
                    "batching beats the celery-batches peer on QPS at ≤ p99",
                    wl,
                    f"{q:.2f}× QPS; p99 {_f(ours['latency']['p99_ms'])} vs {_f(peer['latency']['p99_ms'])} ms",
                    _met(q > 1.0 and p99_ok),
                ]
            )
        elif _ok(r.get("batching")):
            rows.append(["batching beats the celery-batches peer", wl, f"peer {r.get('peer', {}).get('status')}", "–"])
        if _ok(r.get("batching")) and _ok(r.get("int8")):
            speed = _sat(r["int8"], wl)["qps"] / max(1e-9, _sat(r["batching"], wl)["qps"])
            bare = float(results["limit"]["int8"][wl]["best"]["qps"]) / float(lim["best"]["qps"])
            rows.append(
                [
                    "INT8 CPU throughput ≥ 1.5× FP32",
                    wl,
                    f"{speed:.2f}× through the fleet ({bare:.2f}× bare)",
                    _met(speed >= 1.5),
                ]
            )
    dyn = results["models"]["variants"].get("dynamic")
    if dyn:
        ratio = float(dyn["sizes"]["ratio"])
        rows.append(
            [
                "INT8 file ≤ 30 % of FP32",
                "–",
                f"{ratio:.1%} (top-1 agreement "
                f"{dyn['accuracy']['top1_agreement']:.3f}, mean KL {dyn['accuracy']['mean_kl']:.4f})",
                _met(ratio <= 0.30),
            ]
        )
    gen = generation_target(results.get("generation"))
    if gen:
        rows.append(gen)
    d = results.get("dispatch", {}).get("loop")
    if d:
        qps = float(d["summary"]["qps"])
        rows.append(
            [
                "dispatch ≥ 1,000 req/s through one worker",
                "short",
                f"{_f(qps, 0)} req/s, {_f(d['cpu_ms_outside_inference'], 2)} CPU-ms/request",
                _met(qps >= 1000),
            ]
        )
    return rows


def _met(ok: bool) -> str:
    return "met" if ok else "**not met**"


def targets_section(results: dict[str, Any]) -> str:
    """Markdown table of the targets (measured and reported, not asserted)."""
    rows = target_rows(results)
    lines = ["| target | workload | measured | |", "|---|---|---|---|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def dispatch_section(results: dict[str, Any]) -> str:
    """Dispatch-cost figures, the Redis commands per request, the profile, and what they mean."""
    d = results.get("dispatch")
    if not d or "loop" not in d:
        return "Not measured."
    loop = d["loop"]
    cpu = loop["cpu_ms_per_request"]
    total = sum(cpu.values())
    cores = results["meta"]["machine"]["logical_cores"] or 1
    ceiling = cores * 1000.0 / total if total > 0 else float("nan")
    out = [
        f"The identity model `{d['model']}` (one OneHot node) through the full path, one worker "
        f"(C = {d['concurrency']}, max_batch_size {d['max_batch_size']}, "
        f"Celery log level {d['celery_loglevel']}), "
        f"{loop['clients']} closed-loop clients:\n",
        "| figure | value |",
        "|---|---|",
        f"| requests/s through one worker | **{_f(loop['summary']['qps'], 0)}** |",
        f"| lone request round trip p50 / p99 | {_f(d['lone']['latency']['p50_ms'], 2)} / "
        f"{_f(d['lone']['latency']['p99_ms'], 2)} ms |",
        f"| mean batch at that load | {_f(loop['summary']['mean_batch_size'], 2)} |",
        *[f"| CPU-ms per request: {name} | {_f(v, 3)} |" for name, v in cpu.items()],
        f"| engine time per request (inside) | {_f(loop['inference_ms_per_request'], 3)} ms |",
        f"| **CPU-ms per request outside inference** | **{_f(loop['cpu_ms_outside_inference'], 2)}** |",
        f"| CPU-bound ceiling on {cores} cores (cores × 1000 / CPU-ms) | {_f(ceiling, 0)} req/s |",
        f"| Redis commands per request | {_f(loop['redis_calls_total_per_request'], 1)} |",
        "",
        "Redis commands per request: "
        + ", ".join(f"`{k}` {v}" for k, v in loop["redis_calls_per_request"].items())
        + "\n",
    ]
    abls = d.get("ablations") or {}
    if abls:
        out += [
            f"Variants of the same loop (each on its own worker and queue, all served at once, loops interleaved "
            f"in {d.get('rounds', 1)} rounds):\n",
            "| variant | req/s | lone p50 ms | CPU-ms/request producer / Redis / worker | Redis commands/request |",
            "|---|---|---|---|---|",
            _variant_row(f"as served (Celery log level {d['celery_loglevel']})", d["lone"], loop),
        ]
        out += [_variant_row(a["label"], a["lone"], a["loop"]) for a in abls.values()]
        out.append("")
    prof = d.get("profile")
    if prof and prof.get("status") == "ok":
        out.append(
            f"**Where the CPU goes** (py-spy, {prof['duration_s']:.0f} s of the same loop; share of on-CPU "
            "samples whose stack passes through each component, so shares overlap):\n"
        )
        out += ["| component | worker | producer |", "|---|---|---|"]
        comps = list(
            dict.fromkeys(
                [
                    *prof.get("worker", {}).get("components", {}),
                    *prof.get("producer", {}).get("components", {}),
                ]
            )
        )
        for c in comps:
            w = prof.get("worker", {}).get("components", {}).get(c)
            p = prof.get("producer", {}).get("components", {}).get(c)
            out.append(f"| {c} | {_pct(w)} | {_pct(p)} |")
        top = prof.get("worker", {}).get("top_functions", [])
        if top:
            out.append("\nWorker's heaviest leaf functions: " + "; ".join(f"`{f}` {_pct(s)}" for f, s in top[:8]))
        out.append("")
    elif prof:
        out.append(f"Profile: {prof.get('status')}\n")
    out.append(dispatch_findings(results))
    return "\n".join(out)


def _variant_row(name: str, lone: dict[str, Any], loop: dict[str, Any]) -> str:
    cpu = loop["cpu_ms_per_request"]
    return (
        f"| {name} | {_f(loop['summary']['qps'], 0)} | {_f(lone['latency']['p50_ms'], 2)} | "
        f"{_f(cpu['producer'], 2)} / {_f(cpu['redis'], 2)} / {_f(cpu['worker'], 2)} | "
        f"{_f(loop['redis_calls_total_per_request'], 1)} |"
    )


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.0f} %"
