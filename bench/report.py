"""Render a bench run's results (the JSON dict of :mod:`bench.runner`) as ``docs/benchmarks.md``.

The document is the results of ONE run at one commit: :func:`provenance` states the commit, its date,
the run's date and the machine at the top, and marks loudly a run on a tree with uncommitted changes or
results whose phases were measured at different commits. The formatting helpers are pure;
:func:`write_report` writes the Markdown and the plots (and asks git for the commit's date).
"""

from __future__ import annotations

import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.analysis import dispatch_section, targets_section
from bench.ceiling import ceiling_section
from bench.genreport import generation_section, plot_generation
from bench.markdown import fmt, md_table, mib
from bench.notes import last_position_note, method_notes, reading_notes
from bench.plots import plot_latency_vs_qps

__all__ = ["commit_date", "fmt", "limit_at", "md_table", "mib", "provenance", "render", "write_report"]

ROWS = (
    ("baseline", "baseline (FP32, max_batch_size 1)"),
    ("batching", "+ dynamic batching (max_batch_size {b})"),
    ("int8", "+ INT8 (dynamic)"),
    ("tensorrt", "+ TensorRT EP FP16"),
)
HEADERS = [
    "configuration",
    "QPS",
    "mean ms",
    "p50 ms",
    "p95 ms",
    "p99 ms",
    "mean batch",
    "padding eff.",
    "worker peak RSS MiB",
    "model file MiB",
    "QPS / limit",
]


def limit_at(limit: dict[str, Any], batch_size: int) -> float:
    """QPS of the bare loop at ``batch_size`` (NaN when not measured)."""
    for point in limit["points"]:
        if int(point["batch_size"]) == batch_size:
            return float(point["qps"])
    return float("nan")


def _fleet_cells(row: dict[str, Any], wl: str, limit_qps: float) -> list[str]:
    sat = row["workloads"][wl]["saturation"]
    lat = sat["latency"]
    return [
        fmt(sat["qps"]),
        fmt(lat["mean_ms"]),
        fmt(lat["p50_ms"]),
        fmt(lat["p95_ms"]),
        fmt(lat["p99_ms"]),
        fmt(sat["mean_batch_size"], 2),
        fmt(100 * sat["padding_efficiency"], 0) + " %",
        mib(row.get("peak_rss_bytes")),
        mib(row.get("model_bytes")),
        fmt(100 * sat["qps"] / limit_qps, 0) + " %" if limit_qps > 0 else "–",
    ]


def main_table(results: dict[str, Any], wl: str) -> str:
    """The seed's table for workload ``wl``, with the limit and peer rows beside it."""
    rows_out: list[list[str]] = []
    res_rows = results["rows"]
    b = int(results["meta"]["plan"]["max_batch_size"])
    models = results["models"]
    for key, label in ROWS:
        row = res_rows.get(key, {"status": "not run"})
        limit = results["limit"]["int8" if key == "int8" else "fp32"][wl]
        same_b = limit_at(limit, 1 if key == "baseline" else b)
        if row.get("status") != "ok":
            rows_out.append([label.format(b=b), f"**{row.get('status')}**"] + ["–"] * (len(HEADERS) - 2))
            continue
        rows_out.append([label.format(b=b), *_fleet_cells(row, wl, same_b)])
    for variant, path_key in (("fp32", "fp32"), ("int8", "int8")):
        best = results["limit"][variant][wl]["best"]
        size = Path(models[path_key]).stat().st_size if Path(models[path_key]).exists() else None
        rows_out.append(
            [
                f"limit: bare session.run, {variant.upper()}, batch {best['batch_size']}",
                fmt(best["qps"]),
                fmt(best["batch_ms"]),
                "–",
                "–",
                "–",
                str(best["batch_size"]),
                "–",
                "–",
                mib(size),
                "100 %",
            ]
        )
    peer = res_rows.get("peer", {"status": "not run"})
    label = f"peer: celery-batches (flush_every {b})"
    if peer.get("status") == "ok":
        rows_out.append([label, *_fleet_cells(peer, wl, limit_at(results["limit"]["fp32"][wl], b))])
    else:
        rows_out.append([label, f"**{peer.get('status')}**"] + ["–"] * (len(HEADERS) - 2))
    for key, label in (
        ("lean", "ablation: + dynamic batching, lean Celery (measurement-only launcher)"),
        ("spinning", "ablation: + dynamic batching, ORT spin-waiting on"),
    ):
        abl = res_rows.get(key, {})
        if abl.get("status") == "ok":
            rows_out.append([label, *_fleet_cells(abl, wl, limit_at(results["limit"]["fp32"][wl], b))])
    return md_table(HEADERS, rows_out)


def open_loop_table(results: dict[str, Any], wl: str) -> str:
    """Latency under Poisson load: one line per configuration and rate."""
    out = []
    for key in ("baseline", "batching", "int8", "peer"):
        row = results["rows"].get(key, {})
        if row.get("status") != "ok":
            continue
        entry = row["workloads"][wl]
        lone = entry["lone"]
        out.append(
            [
                key,
                "1 client",
                fmt(lone["qps"]),
                fmt(lone["latency"]["p50_ms"]),
                fmt(lone["latency"]["p99_ms"]),
                fmt(lone["mean_batch_size"], 2),
            ]
        )
        for point in entry["open"]:
            s = point["summary"]
            out.append(
                [
                    key,
                    f"Poisson {fmt(point['offered_qps'])}/s",
                    fmt(s["qps"]),
                    fmt(s["latency"]["p50_ms"]),
                    fmt(s["latency"]["p99_ms"]),
                    fmt(s["mean_batch_size"], 2),
                ]
            )
    return md_table(["configuration", "load", "achieved QPS", "p50 ms", "p99 ms", "mean batch"], out)


def limit_table(results: dict[str, Any]) -> str:
    """Bare session.run throughput (req/s) by batch size, per variant and workload."""
    sizes = [int(p["batch_size"]) for p in results["limit"]["fp32"]["long"]["points"]]
    rows = []
    names = {
        "fp32": "FP32",
        "int8": "INT8",
        "fp32_last": "FP32, LM head at last position",
        "int8_last": "INT8, LM head at last position",
    }
    for variant in [v for v in names if v in results["limit"]]:
        for wl, entry in results["limit"][variant].items():
            cells = [fmt(limit_at(entry, b)) for b in sizes]
            spin = entry.get("best_spinning")
            rows.append(
                [
                    names[variant],
                    wl,
                    *cells,
                    fmt(entry["bare_lone_ms"], 2),
                    fmt(spin["qps"]) + f" (b={spin['batch_size']})" if spin else "–",
                ]
            )
    return md_table(["model", "workload", *[f"b={b}" for b in sizes], "lone run ms (p50)", "spinning on"], rows)


def int8_table(results: dict[str, Any]) -> str:
    """The quantization reports of the INT8 variants."""
    rows = []
    for name, rep in results["models"]["variants"].items():
        acc, lat = rep["accuracy"], rep["latency"]
        rows.append(
            [
                f"{name} ({rep['quantization']})",
                fmt(100 * rep["sizes"]["ratio"], 1) + " %",
                fmt(acc["top1_agreement"], 3),
                fmt(acc["mean_kl"], 4),
                fmt(acc["max_abs_delta_logprob"], 3),
                fmt(acc["max_abs_delta_logprob_top5"], 3),
                fmt(lat["speedup"], 2) + "×",
                "written" if rep["written"] else "refused: " + "; ".join(rep["gate"]["failures"]),
            ]
        )
    return md_table(
        [
            "variant",
            "file vs FP32",
            "top-1 agreement",
            "mean KL (nats)",
            "max |Δ log p|",
            "max |Δ log p| top-5",
            "bare speed vs FP32",
            "gate",
        ],
        rows,
    )


def machine_table(meta: dict[str, Any]) -> str:
    """Machine and software facts."""
    m = meta["machine"]
    pk = m["packages"]
    rows = [
        ["CPU", f"{m['cpu']} — {m['logical_cores']} logical / {m['physical_cores']} physical cores"],
        ["memory", f"{m['memory_gib']} GiB"],
        ["OS", m["os"]],
        ["Python", m["python"]],
        ["packages", ", ".join(f"{k} {v}" for k, v in pk.items())],
        ["redis-server", m["redis_server"]],
        ["ORT providers", ", ".join(m["ort_providers"])],
        ["GPU", "yes" if m["gpu"] else "none"],
        [
            "load average (1/5/15 min) at start → end",
            f"{m['load_average_start']} → {meta.get('load_average_end')}",
        ],
        ["commit", f"{m['git_commit']}{' **with uncommitted changes**' if m['git_dirty'] else ''}"],
    ]
    return md_table(["", ""], rows)


def _phase_stamps(results: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """(commit, dirty) of the run and of each phase that records its own (a phase rerun alone does)."""
    m = results["meta"]["machine"]
    stamps = {"the run": (str(m.get("git_commit")), bool(m.get("git_dirty")))}
    for phase in ("dispatch", "generation"):
        meta = (results.get(phase) or {}).get("meta")
        if meta and meta.get("commit"):
            stamps[phase] = (str(meta["commit"]), bool(meta.get("dirty")))
    return stamps


def provenance(results: dict[str, Any], commit_day: str | None) -> str:
    """Markdown: what was measured where and when (commit, its date, the run's date, the machine), with a
    loud warning when the tree had uncommitted changes or a phase was measured at another commit.

    ``commit_day``: the commit's date (``YYYY-MM-DD``), None when git does not know the commit."""
    meta, m = results["meta"], results["meta"]["machine"]
    started = meta.get("started_unix_s")
    when = datetime.fromtimestamp(float(started), UTC).strftime("%Y-%m-%d %H:%M UTC") if started else "an unknown date"
    commit = m.get("git_commit") or "unknown"
    lines = [
        f"Measured on {when} at commit `{commit}`" + (f" (committed {commit_day})" if commit_day else "")
        + f" on {m['cpu']}, {m['logical_cores']} logical cores, {m['memory_gib']} GiB "
        "(details under *Machine*).\n"
    ]
    stamps = _phase_stamps(results)
    dirty = [name for name, (_, d) in stamps.items() if d]
    if dirty:
        lines.append(
            "> **Warning: not a committed state.** The working tree had uncommitted changes when these were "
            "measured: " + ", ".join(dirty) + ". Their figures belong to no commit; rerun `fleet bench` on a clean "
            "checkout before relying on them.\n"
        )
    others = {name: c for name, (c, _) in stamps.items() if c != commit}
    if others:
        lines.append(
            "> **Warning: not one run.** "
            + "; ".join(f"{name} was measured separately at commit `{c}`" for name, c in others.items())
            + f", not at `{commit}`. Rerun `fleet bench` to measure every phase together.\n"
        )
    return "\n".join(lines)


_CONTENTS = (
    "What each part answers: **the tables** (one per prompt length) — how many requests/s each serving "
    "configuration carries at saturation and at what latency, against the bare `session.run` limit of the same "
    "model; **Targets** — the goals set for the fleet, met or not; **Latency under load** — latency as offered "
    "load rises; **INT8** — what quantization costs in accuracy and gains in speed; **The limit** — the bare "
    "loop by batch size; **Dispatch cost** — what the queue itself costs per request (Redis commands, CPU) on a "
    "zero-cost model, and why; **Generation** — tokens/s and time to first token of one-at-a-time, static and "
    "continuous batching; **Same weights** — the fleet against a bare numpy + ONNX Runtime loop and "
    "onnxruntime-genai's `og.Engine` on one Llama exported both ways, tokens compared; **guidellm** — vLLM's "
    "load client, unchanged, sweeping the gateway; **How it was measured**.\n"
)


def render(results: dict[str, Any], img_rel: str, commit_day: str | None = None) -> str:
    """The whole Markdown document (``img_rel``: the plots' folder relative to the document; ``commit_day``:
    the measured commit's date, see :func:`provenance`)."""
    meta = results["meta"]
    model = meta["model"]
    plan = meta["plan"]
    peer = results["rows"].get("peer", {})
    parts = [
        "# Benchmarks\n",
        "Generated by the command below from one run; rerunning it regenerates this file, its plots "
        "and the raw results (JSON). Every figure was measured on the real path (FleetClient → Redis → "
        "`celery worker` subprocess → result) except the limit rows (a bare `session.run` loop in the "
        "bench process). Ratios are side by side in one run on one shared machine.\n",
        f"```\n{meta['command']}\n```\n",
        provenance(results, commit_day),
        f"Run took **{meta['duration_s']:.0f} s**"
        f"{' (quick mode: demo model, short phases)' if meta['quick'] else ''}."
        f" Model: `{model['name']}` {model['version']} ({model['parameters'] / 1e6:.1f} M weights, "
        f"{model['num_layers']} layers, hidden {model['hidden_size']}, vocab {model['vocab_size']}); INT8 = "
        f"`{meta['int8_version']}`. Workers: threads pool, C = {plan['concurrency']} tokens, "
        f"max_wait_ms {plan['max_wait_ms']}, ORT spin-waiting off, Celery log level WARNING. "
        f"Saturation = {plan['concurrency']} closed-loop clients.\n",
        _CONTENTS,
        "## Machine\n",
        machine_table(meta) + "\n",
    ]
    for wl, (lo, hi) in (("long", (128, 256)), ("short", (8, 16))):
        parts += [
            f"## The table — {wl} prompts ({lo}–{hi} tokens)\n",
            "Saturation throughput and latency (submit → result available); `QPS / limit` compares with the "
            "bare loop of the same model at the same batch size (batch 1 for the baseline).\n",
            main_table(results, wl) + "\n",
        ]
    parts += ["## Reading the tables\n", reading_notes(results)]
    parts += ["## Targets\n", "Measured and reported here, never asserted in tests.\n", targets_section(results) + "\n"]
    parts += [
        "## Latency under load\n",
        "p50 (solid) and p99 (dashed) against achieved QPS: one client, open-loop Poisson arrivals at "
        f"{', '.join(f'{f:.0%}' for f in plan['open_fractions'])} of each configuration's own saturation "
        "QPS, and saturation.\n",
    ]
    for wl in ("long", "short"):
        parts += [
            f"![latency vs QPS, {wl} prompts]({img_rel}/latency-vs-qps-{wl}.png)\n",
            f"**{wl} prompts**\n",
            open_loop_table(results, wl) + "\n",
        ]
    parts += [
        "## INT8\n",
        "`fleet quantize` on the served model, compared with FP32 on held-out prompts:\n",
        int8_table(results) + "\n",
    ]
    parts += [
        "## The limit (bare `session.run`, requests/s by batch size)\n",
        limit_table(results) + "\n",
        last_position_note(results),
    ]
    parts += ["## Dispatch cost\n", dispatch_section(results) + "\n", ceiling_section(results)]
    parts += [
        "The bulk path with large chunks (512 requests per message, a burst of 2,000 requests) against one task "
        "per request, end to end: [bulk-path.md](bulk-path.md) (`python -m bench.bulk_vs_single`).\n"
    ]
    parts += [generation_section(results, img_rel)]
    parts += [same_weights_section(results), guidellm_section(results)]
    peer_note = (
        f"celery-batches peer: Celery {peer.get('celery', '?')} in its own virtualenv, threads pool, "
        f"concurrency 1, prefetch multiplier 64, flush_every {plan['max_batch_size']}, flush_interval "
        f"{plan['peer_flush_interval_s'] * 1000:.0f} ms, acks late, the same ORT options, same "
        "messages and same result schema (it skips the fleet's input validation)."
        if peer.get("status") == "ok"
        else f"Peer row: {peer.get('status', 'not run')}."
    )
    parts += ["## How it was measured\n", method_notes(plan)]
    parts += [
        "## Notes\n",
        f"- {peer_note}",
        "- TensorRT row: measured only where the TensorRT EP loads (onnxruntime-gpu, the TensorRT libraries) "
        "and a GPU is present; otherwise the row states why it was not run, never estimated.",
        "- The machine is shared: other processes may run during the bench (see the load average above); "
        "compare ratios within this run rather than absolute figures across runs.\n",
    ]
    return "\n".join(parts)


def same_weights_section(results: dict[str, Any]) -> str:
    """``## Same weights``: :func:`bench.same_weights.same_weights_body`, or why it did not run."""
    from bench.same_weights import same_weights_body

    sw = results.get("same_weights", {"status": "not run (results from before this phase existed)"})
    body = same_weights_body(sw, "###") if sw.get("status") == "ok" else [f"{sw['status']}.", ""]
    return "\n".join(["## Same weights: the fleet, a bare loop and onnxruntime-genai\n", *body])


def guidellm_section(results: dict[str, Any]) -> str:
    """``## guidellm``: :func:`bench.guidellm_sweep.guidellm_body`, or why it did not run."""
    from bench.guidellm_sweep import guidellm_body

    gl = results.get("guidellm", {"status": "not run (results from before this phase existed)"})
    body = guidellm_body(gl) if gl.get("status") == "ok" else [f"{gl['status']}.", ""]
    return "\n".join(["## guidellm against the gateway\n", *body])


def commit_date(commit: str) -> str | None:
    """The committer date (``YYYY-MM-DD``) of ``commit`` in this checkout; None when git does not know it."""
    try:
        done = subprocess.run(
            ["git", "show", "-s", "--format=%cs", commit, "--"], cwd=Path(__file__).resolve().parents[1],
            capture_output=True, text=True, timeout=10, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    day = done.stdout.strip()
    return day if done.returncode == 0 and day else None


def write_report(results: dict[str, Any], out_md: Path, img_dir: Path) -> None:
    """Write the plots into ``img_dir`` and the Markdown into ``out_md``."""
    img_dir.mkdir(parents=True, exist_ok=True)
    for wl in ("long", "short"):
        plot_latency_vs_qps(results, wl, img_dir / f"latency-vs-qps-{wl}.png")
    plot_generation(results, img_dir / "generation-vs-load.png")
    out_md.parent.mkdir(parents=True, exist_ok=True)
    try:
        rel = img_dir.resolve().relative_to(out_md.parent.resolve()).as_posix()
    except ValueError:
        rel = img_dir.resolve().as_posix()
    commit = results["meta"]["machine"].get("git_commit")
    out_md.write_text(render(results, rel, commit_date(commit) if commit else None))
