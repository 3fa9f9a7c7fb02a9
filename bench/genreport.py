"""The report's generation section: tables, the continuous-batching target, what limits it, and a plot.

Every figure comes from ``results["generation"]`` (:func:`bench.generation.measure_generation`),
so a rerun (``fleet bench``) rewrites the argument with its own numbers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.gennotes import TARGET_RATIO, generation_reading, pct
from bench.markdown import fmt, md_table

__all__ = ["TARGET_RATIO", "generation_section", "generation_target", "plot_generation"]

SERIES = (("one_at_a_time", "tab:gray"), ("static", "tab:orange"), ("continuous", "tab:blue"))


def _ok(gen: dict[str, Any], key: str) -> bool:
    return bool(gen.get("rows", {}).get(key, {}).get("status") == "ok")


def generation_target(gen: dict[str, Any] | None) -> list[str] | None:
    """[target, workload, measured, met?] of the continuous-batching target; None when not measured."""
    if not gen or not (_ok(gen, "continuous") and _ok(gen, "one_at_a_time")):
        return None
    cont, one = gen["rows"]["continuous"]["saturation"], gen["rows"]["one_at_a_time"]["saturation"]
    ratio = cont["tokens_per_s"] / max(1e-9, one["tokens_per_s"])
    return [
        f"continuous batching ≥ {TARGET_RATIO:g}× one-at-a-time tokens/s at saturation",
        "generation",
        f"{ratio:.2f}× ({fmt(cont['tokens_per_s'])} vs {fmt(one['tokens_per_s'])} tokens/s; TTFT p99 "
        f"{fmt(cont['ttft']['p99_ms'], 0)} vs {fmt(one['ttft']['p99_ms'], 0)} ms)",
        "met" if ratio >= TARGET_RATIO else "**not met**",
    ]


def _sat_cells(s: dict[str, Any], base: float) -> list[str]:
    return [
        fmt(s["tokens_per_s"]), f"{s['tokens_per_s'] / base:.2f}×" if base > 0 else "–",
        fmt(s["ttft"]["p50_ms"], 0), fmt(s["ttft"]["p99_ms"], 0),
        fmt(s["inter_token"]["p50_ms"], 1), fmt(s["inter_token"]["p99_ms"], 1),
        fmt(s["latency"]["p50_ms"], 0), fmt(s["latency"]["p99_ms"], 0), fmt(s["mean_batch"], 1),
    ]  # fmt: skip


def saturation_table(gen: dict[str, Any]) -> str:
    """Tokens/s and latencies of every row with the whole workload submitted at once."""
    rows, lim = gen["rows"], gen["limit"]
    base = float(rows.get("one_at_a_time", {}).get("saturation", {}).get("tokens_per_s", 0.0))
    out = []
    for key, _ in SERIES:
        row = rows.get(key, {})
        if row.get("status") != "ok":
            out.append([key, f"**{row.get('status', 'not run')}**", *["–"] * 10])
            continue
        copy = row["saturation"].get("worker", {}).get("copy_share")
        out.append([row["label"], *_sat_cells(row["saturation"], base), pct(copy)])
    for name, run in lim["loop"].items():
        cells = [fmt(run["tokens_per_s"]), f"{run['tokens_per_s'] / base:.2f}×" if base > 0 else "–",
                 fmt(run["ttft"]["p50_ms"], 0), fmt(run["ttft"]["p99_ms"], 0), fmt(run["inter_token"]["p50_ms"], 1),
                 fmt(run["inter_token"]["p99_ms"], 1), "–", "–", fmt(run["shares"]["mean_running"], 1),
                 pct(run["shares"]["copy_share"])]  # fmt: skip
        out.append([f"in process: {name} generation loop (no Celery, no Redis)", *cells])
    best = lim["best"]
    out.append([f"limit: bare decode loop, batch {best['batch_size']} (nobody leaves)", fmt(best["tokens_per_s"]),
                f"{best['tokens_per_s'] / base:.2f}×" if base > 0 else "–", *["–"] * 6,
                str(best["batch_size"]), "–"])  # fmt: skip
    headers = ["configuration", "tokens/s", "× one at a time", "TTFT p50 ms", "TTFT p99 ms", "inter-token p50 ms",
               "inter-token p99 ms", "latency p50 ms", "latency p99 ms", "mean batch", "KV copy share"]  # fmt: skip
    return md_table(headers, out)


def load_table(gen: dict[str, Any]) -> str:
    """Every row at each offered load (Poisson arrivals)."""
    out = []
    for i in range(len(gen["rows"].get("continuous", {}).get("open", []))):
        for key, _ in SERIES:
            row = gen["rows"].get(key, {})
            if row.get("status") != "ok":
                continue
            p = row["open"][i]
            s = p["summary"]
            load = f"{fmt(p['offered_rps'], 2)} req/s ({fmt(p['offered_tokens_per_s'], 0)} tokens/s)"
            out.append([
                f"{load}, {p['requests']} requests", key.replace("_", " "), fmt(s["tokens_per_s"]),
                fmt(s["ttft"]["p50_ms"], 0), fmt(s["ttft"]["p99_ms"], 0),
                fmt(s["inter_token"]["p99_ms"], 1), fmt(s["latency"]["p99_ms"], 0), fmt(s["mean_batch"], 1),
            ])  # fmt: skip
    headers = ["offered load", "configuration", "tokens/s", "TTFT p50 ms", "TTFT p99 ms", "inter-token p99 ms",
               "latency p99 ms", "mean batch"]  # fmt: skip
    return md_table(headers, out)


def limit_table(gen: dict[str, Any]) -> str:
    """The bare decode loop by batch size."""
    rows = [
        [str(p["batch_size"]), fmt(p["tokens_per_s"]), fmt(p["decode_tokens_per_s"]), fmt(p["step_ms"], 1),
         fmt(p["prefill_ms"], 0), fmt(p["relayout_ms"], 1)]
        for p in gen["limit"]["points"]
    ]  # fmt: skip
    return md_table(["batch", "tokens/s (prefill counted)", "decode-only tokens/s", "ms per decode step",
                     "prefill ms (whole batch)", "KV layout ms"], rows)  # fmt: skip


def steps_table(gen: dict[str, Any]) -> str:
    """Where the generation loop's step time went, in process and (copy only) in the workers."""
    out = []
    for name, run in gen["limit"]["loop"].items():
        sh = run["shares"]
        out.append([f"in process, {name}", pct(sh["prefill_share"]), pct(sh["copy_share"]), pct(sh["decode_share"]),
                    fmt(sh["mean_running"], 1), fmt(sh["steps"], 0), fmt(sh["relayouts"], 0),
                    fmt(sh["copy_ms_per_relayout"], 1), pct(sh.get("kv_fill"))])  # fmt: skip
    for key in ("static", "continuous"):
        w = gen["rows"].get(key, {}).get("saturation", {}).get("worker")
        if w:
            per = 1000 * w["copy_s"] / w["relayouts"] if w["relayouts"] else float("nan")
            out.append([f"worker, {key} (saturation)", "–", pct(w["copy_share"]), "–", "–", fmt(w["steps"], 0),
                        fmt(w["relayouts"], 0), fmt(per, 1), "–"])  # fmt: skip
    return md_table(["run", "prefill", "KV re-layout (copy)", "decode", "mean decode batch", "steps", "re-layouts",
                     "ms per re-layout", "KV fill"], out)  # fmt: skip


def _relayout_note(gen: dict[str, Any]) -> str:
    r = gen["limit"].get("relayout")
    if not r:
        return ""
    return (
        f"One membership change at batch {r['batch_size']} (cache width {r['cache_width']} tokens, "
        f"{fmt(r['cache_mib'], 1)} MiB of KV cache): `KVState.relayout` dropping one row and joining one sequence "
        f"takes {fmt(r['relayout_ms'], 1)} ms; one copy of the cache it produces into preallocated arrays takes "
        f"{fmt(r['one_copy_ms'], 1)} ms, so the re-layout moves the cache about {fmt(r['copies'], 1)} times over "
        "(`workers.generation.kvcache.relayout` copies each real entry once, reading the kept rows straight from "
        "ORT's memory; the rest is allocation and zeroing the padding).\n"
    )


def generation_section(results: dict[str, Any], img_rel: str) -> str:
    """The ``## Generation`` section (a one-line note when the run did not measure it)."""
    gen = results.get("generation")
    if not gen:
        return "## Generation\n\nNot measured in this run.\n"
    meta, wl, gp = gen.get("meta", {}), gen["workload"], gen["plan"]
    target = generation_target(gen)
    parts = [
        "## Generation — continuous batching\n",
        f"This phase took {fmt(gen['duration_s'], 0)} s (load average {meta.get('load_average_start')} → "
        f"{meta.get('load_average_end')}). Model `{gen['model']}`; "
        f"{wl['requests']} `generate` requests per saturation round, {gp.get('rounds', 1)} rounds (the rows' order "
        "reversed every other round, pooled); requests are `fleet.infer` tasks, greedy, `ignore_eos`; prompts "
        f"{gp['prompt_tokens'][0]}–{gp['prompt_tokens'][1]} tokens (mean {fmt(wl['prompt_tokens_mean'], 0)}), outputs "
        f"{gp['output_tokens'][0]}–{gp['output_tokens'][1]} tokens (mean {fmt(wl['output_tokens_mean'], 0)}, "
        f"{wl['output_tokens_total']} in all). Each row is its own worker on its own queue, served at once, "
        "visited in turn.\n",
        "### Saturation (the whole workload submitted at once)\n",
        "Tokens/s = generated tokens / (first submit → last result). TTFT = producer submit → first token (the "
        "worker's figure); inter-token = each request's mean gap between tokens; latency = submit → result, as "
        "the client saw it. *KV copy share* = the step time spent re-laying out the cache when rows leave or join "
        "(the workers' `fleet_worker_kv_copy_seconds` / `fleet_worker_generation_step_seconds`).\n",
        saturation_table(gen) + "\n",
    ]
    if target:
        parts.append(md_table(["target", "workload", "measured", ""], [target]) + "\n")
    parts += [
        generation_reading(gen),
        "### Under offered load\n",
        f"Poisson arrivals at {', '.join(f'{f:.0%}' for f in gp['open_fractions'])} of the continuous row's saturation "
        f"request rate, the same requests for every row (rate × {gp['open_duration_s']:g} s, clamped to "
        f"{gp['open_min_requests']}–{gp['open_max_requests']} requests, so a p99 is close to the maximum); the "
        "dashed lines are each row's saturation tokens/s. The rows of one load point run within seconds of each "
        "other; the saturation rounds ran earlier, so on a shared machine whose background load changes (see the "
        "load average above) compare rows at one load point rather than a load point with a dashed line.\n",
        f"![generation: tokens/s and TTFT p99 against offered load]({img_rel}/generation-vs-load.png)\n",
        load_table(gen) + "\n",
        "### The limit and where a step's time goes\n",
        "The bare decode loop drives the worker's own `Decoder` and `KVState` in this process: prefill a batch of "
        "the workload's prompts, then the same number of decode steps for every row (no row leaves or joins):\n",
        limit_table(gen) + "\n",
        "The worker's `GenerationLoop` in this process over the saturation workload (observer on `loop.observers`), "
        "and the workers' own copy time during the saturation runs; *KV fill* = real tokens / (rows × cache "
        "width) in the decode batch:\n",
        steps_table(gen) + "\n",
        _relayout_note(gen),
        "ONNX Runtime's profile of a decode step "
        f"(batch {gen['limit']['profile']['batch_size']}, {gen['limit']['profile']['past_tokens']} cached tokens), "
        "share of node time by operator: "
        + ", ".join(f"{op} {pct(v)}" for op, v in gen["limit"]["profile"]["top_ops"].items())
        + ".\n",
    ]
    return "\n".join(parts)


def plot_generation(results: dict[str, Any], path: Path) -> Path | None:
    """Tokens/s (left) and TTFT p99 (right, log) against offered load; None when not measured."""
    gen = results.get("generation")
    if not gen:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2), dpi=110)
    for key, color in SERIES:
        row = gen["rows"].get(key, {})
        if row.get("status") != "ok":
            continue
        pts = sorted((p["offered_rps"], p["summary"]) for p in row["open"])
        x = [p[0] for p in pts]
        label = key.replace("_", " ")
        left.plot(x, [s["tokens_per_s"] for _, s in pts], "o-", color=color, label=label)
        left.axhline(row["saturation"]["tokens_per_s"], color=color, ls="--", alpha=0.6)
        right.plot(x, [s["ttft"]["p99_ms"] for _, s in pts], "s-", color=color, label=label)
    left.set_xlabel("offered load (requests/s, Poisson)")
    left.set_ylabel("generated tokens/s")
    left.set_title("throughput (dashed: saturation)")
    right.set_xlabel("offered load (requests/s, Poisson)")
    right.set_ylabel("time to first token, p99 (ms)")
    right.set_yscale("log")
    from matplotlib.ticker import ScalarFormatter

    right.yaxis.set_major_formatter(ScalarFormatter())
    right.set_title("TTFT p99")
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{gen['model']}: generation under load")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
