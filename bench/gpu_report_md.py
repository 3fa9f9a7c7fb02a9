"""The Markdown of ``fleet gpu-report`` (:mod:`bench.gpu_report`), rendered from its JSON results alone."""

from __future__ import annotations

from typing import Any

__all__ = ["render"]

_SHORT = {"TensorrtExecutionProvider": "TensorRT", "CUDAExecutionProvider": "CUDA", "CPUExecutionProvider": "CPU"}


def _short(name: str) -> str:
    return _SHORT.get(name, name.replace("ExecutionProvider", ""))


def _num(value: Any, digits: int = 0) -> str:
    if value is None:
        return "–"
    return f"{float(value):,.{digits}f}"


def _pct(value: Any) -> str:
    return "–" if value is None else f"{100 * float(value):.0f} %"


def _environment(env: dict[str, Any]) -> list[str]:
    gpu = env["gpu"]
    gpus = gpu.get("gpus") or []
    gpu_line = (
        "; ".join(f"{g['name']} ({g['memory']}, compute capability {g['compute_capability']})" for g in gpus)
        if gpus
        else f"none ({gpu.get('reason', 'no GPU')})"
    )
    driver = f"driver {gpus[0]['driver']}, CUDA {gpu.get('driver_cuda', 'unknown')} (driver's)" if gpus else "none"
    pk = env["packages"]
    return [
        "| | |",
        "|---|---|",
        f"| GPU | {gpu_line} |",
        f"| driver | {driver} |",
        f"| ONNX Runtime | {env['onnxruntime']} |",
        f"| CUDA libraries | {env.get('cuda_libraries', '–')} |",
        f"| CPU | {env['cpu']}, {env['logical_cores']} logical cores, {env['memory_gib']} GiB |",
        f"| software | Python {env['python']}, numpy {pk.get('numpy')}, onnx {pk.get('onnx')}, "
        f"celery {pk.get('celery')}, kombu {pk.get('kombu')}, redis-py {pk.get('redis')} |",
        f"| commit | {env['git_commit']}{' (with uncommitted changes)' if env['git_dirty'] else ''}, "
        f"{env['date_utc']} |",
    ]


def _providers(rows: list[dict[str, Any]]) -> list[str]:
    out = ["| provider | in this build | loads | why not |", "|---|---|---|---|"]
    for r in rows:
        out.append(
            f"| {_short(r['provider'])} | {'yes' if r['in_build'] else 'no'} | {'**yes**' if r['loads'] else 'no'} "
            f"| {r['reason'] or ''} |"
        )
    return out


def _placement(rows: list[dict[str, Any]]) -> list[str]:
    out = ["| model | chain | active providers | nodes per provider | on the first provider |", "|---|---|---|---|---|"]
    for r in rows:
        nodes = ", ".join(f"{_short(p)} {n}" for p, n in r["nodes"].items())
        first = r["active"][0] if r["active"] else ""
        share = r["nodes"].get(first, 0) / r["total"] if r["total"] else 0.0
        out.append(f"| {r['model']} | {r['chain']} | {' → '.join(_short(a) for a in r['active'])} | {nodes} "
                   f"| {_pct(share)} |")  # fmt: skip
    return out


def _ceiling(ceiling: dict[str, Any]) -> list[str]:
    sizes = [p["batch_size"] for p in next(iter(ceiling.values()))["points"]]
    out = [
        "| model | " + " | ".join(f"batch {b}" for b in sizes) + " | lone request |",
        "|---|" + "---|" * (len(sizes) + 1),
    ]
    for variant, entry in ceiling.items():
        cells = " | ".join(
            f"**{_num(p['qps'])}**" if p is entry["best"] or p["batch_size"] == entry["best"]["batch_size"]
            else _num(p["qps"])
            for p in entry["points"]
        )  # fmt: skip
        out.append(f"| {variant} | {cells} | {_num(entry['lone_ms'], 2)} ms |")
    return out


def _fleet(results: dict[str, Any]) -> list[str]:
    out = [
        "| configuration | max batch | req/s | mean batch | p50 ms | p99 ms | errors | of the ceiling (best batch) "
        "| of the ceiling (at its max batch) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    shares = results.get("shares", {})
    for key, row in results["fleet"].items():
        s = shares.get(key, {})
        pr = row["per_request"]
        out.append(
            f"| {row['label']} — `fleet.infer` | {row['max_batch_size']} | {_num(pr['qps'])} | "
            f"{_num(pr['mean_batch_size'], 1)} | {_num(pr['p50_ms'], 1)} | {_num(pr['p99_ms'], 1)} | {pr['errors']} | "
            f"{_pct(s.get('per_request_of_best'))} | {_pct(s.get('per_request_of_capped'))} |"
        )
        if "bulk" in row:
            b = row["bulk"]
            out.append(
                f"| {row['label']} — bulk path, {b['chunk']} per message | {row['max_batch_size']} | {_num(b['qps'])} "
                f"| {_num(b['mean_batch_size'], 1)} | {_num(b['p50_ms'], 1)} | {_num(b['p99_ms'], 1)} | {b['errors']} "
                f"| {_pct(s.get('bulk_of_best'))} | {_pct(s.get('bulk_of_capped'))} |"
            )
    return out


def _scaling(rows: list[dict[str, Any]], results: dict[str, Any]) -> list[str]:
    best = results["ceiling"]["fp32"]["best"]["qps"]
    out = ["| workers on the device | req/s | × one worker | mean batch | p50 ms | p99 ms | errors | of the ceiling |",
           "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    one = rows[0]["qps"] if rows else 0.0
    for r in rows:
        out.append(
            f"| {r['workers']} | {_num(r['qps'])} | {r['qps'] / one:.2f}× | {_num(r['mean_batch_size'], 1)} "
            f"| {_num(r['p50_ms'], 1)} | {_num(r['p99_ms'], 1)} | {r['errors']} | {_pct(r['qps'] / best)} |"
        )
    return out


def _worker_nodes(fleet: dict[str, Any]) -> list[str]:
    counted = {row["label"]: row.get("nodes_at_load") or {} for row in fleet.values()}
    if not any(counted.values()):
        return []
    out = ["", "Nodes per provider each worker counted at model load (its heartbeat; `fleet status` shows the same):",
           ""]  # fmt: skip
    out += [f"- {label}: {', '.join(f'{_short(p)} {n}' for p, n in nodes.items()) or 'not counted'}"
            for label, nodes in counted.items()]  # fmt: skip
    return out


def _generation(gen: dict[str, Any]) -> list[str]:
    out = ["| configuration | tokens/s | requests/s | TTFT p50 ms | inter-token p50 ms |", "|---|---|---|---|---|"]
    for row in gen["rows"].values():
        out.append(f"| {row['label']} | {_num(row['tokens_per_s'])} | {_num(row['requests_per_s'], 1)} | "
                   f"{_num(row['ttft_p50_ms'], 1)} | {_num(row['inter_token_p50_ms'], 1)} |")  # fmt: skip
    lim = gen["limit_best"]
    out.append(
        f"\nIn-process decode loop (no queue), best: {_num(lim['tokens_per_s'])} tokens/s at batch "
        f"{lim['batch_size']} ({_num(lim['step_ms'], 2)} ms per step)."
    )
    rows = gen["rows"]
    if rows.get("continuous", {}).get("tokens_per_s") and rows.get("one_at_a_time", {}).get("tokens_per_s"):
        ratio = float(rows["continuous"]["tokens_per_s"]) / float(rows["one_at_a_time"]["tokens_per_s"])
        out.append(f"Continuous batching / one request at a time: **{ratio:.1f}×** tokens/s.")
    return out


def _transfers(t: dict[str, Any]) -> list[str]:
    out = [
        f"Device of the cache: **{t['device']}** ({' → '.join(_short(p) for p in t['providers'])}). {t['rows']} rows, "
        f"prompts of {t['prompt_tokens']} tokens, {t['steps']} decode steps at a fixed membership, then one row "
        "leaves.",
        "",
        "| phase | host→device bytes | device→host bytes | tokens | bytes per token (both ways) |",
        "|---|---|---|---|---|",
    ]
    for name, phase in {**t["phases"], "**all**": t["total"]}.items():
        out.append(f"| {name} | {_num(phase['h2d_bytes'])} | {_num(phase['d2h_bytes'])} | {phase['tokens']} "
                   f"| {_num(phase['bytes_per_token'])} |")  # fmt: skip
    what = "The slot buffers (preallocated)" if "slots" in t else "The cache at the end"
    out += ["", f"{what}: {_num(t['cache_bytes_at_end'])} bytes."]
    if t.get("note"):
        out += ["", t["note"]]
    return out


def render(results: dict[str, Any], *, json_name: str = "gpu-report.json") -> str:
    """The whole report as Markdown."""
    env = results["environment"]
    meta = results["meta"]
    phases = ", ".join(f"{k} {v:.0f} s" for k, v in meta["phases_s"].items())
    lines = [
        "# GPU report",
        "",
        f"Generated by `{meta['command']}` in {meta['duration_s']:.0f} s ({phases}); raw figures in "
        f"[{json_name}]({json_name}). Every figure below comes from this one run; times are absolute on the "
        "machine below, shares are measured side by side in the run.",
        "",
        "## Machine",
        "",
        *_environment(env),
        "",
        "## Execution providers",
        "",
        "Each provider is loaded for real over a one-node graph; a missing one quotes the loader's message.",
        "",
        *_providers(results["providers"]),
        "",
        f"Ceiling, fleet and generation below ran on the **{results['provider']}** chain.",
        "",
        "## Node placement",
        "",
        "Nodes each provider ran in one profiled `session.run` of the graph the workers serve (ONNX Runtime's "
        "profiler, `args.provider` per node). A node on CPU inside a GPU chain copies its tensors across the bus.",
        "",
        *_placement(results["placement"]),
        "",
        "## Engine ceiling (bare `session.run`, requests/s)",
        "",
        "The graph the workers serve, in a tight loop of pre-padded batches of the same prompts "
        f"({meta['plan']['prompt_tokens'][0]}–{meta['plan']['prompt_tokens'][1]} tokens); best batch in bold.",
        "",
        *_ceiling(results["ceiling"]),
        "",
        "## The fleet against the ceiling",
        "",
        "One `celery worker` per configuration (Redis, Celery, the worker's micro-batching), clients in closed "
        f"loops at saturation ({meta['plan']['concurrency']} clients; the bulk path: "
        f"{meta['plan']['bulk_clients']} clients of {meta['plan']['bulk_chunk']}-request messages).",
        "",
        *_fleet(results),
        *_worker_nodes(results["fleet"]),
        "",
        "## More workers on one device",
        "",
        "FP32 batching served by several `celery worker` processes of one model (one queue) on the same device, "
        f"loaded by {meta['plan']['scale_processes']} client processes of {meta['plan']['scale_clients']} closed-loop "
        "clients each (one client process alone cannot load more than one worker).",
        "",
        *_scaling(results["scaling"], results),
        "",
        "## Generation",
        "",
        *_generation(results["generation"]),
        *_generation_fp16(results.get("generation_fp16")),
        "",
        "## Host↔device copies per generated token",
        "",
        "### Concat cache (FP32 graph)",
        "",
        *_transfers(results["transfers"]),
        *_transfers_in_place(results.get("transfers_in_place")),
        "",
        *_decode_graphs(results.get("decode_graphs")),
    ]
    return "\n".join(lines)


def _decode_graphs(g: dict[str, Any] | None) -> list[str]:
    """The decode-graphs phase (:mod:`bench.cuda_graphs`): one row per variant, ratios against ordinary steps."""
    if not g:
        return []
    head = ["## Decode steps as CUDA graphs (`engine.cuda_graph`)", ""]
    chain = " → ".join(_short(p) for p in g["providers"])
    if "skipped" in g:
        return [*head, f"Not measured on this chain ({chain}): {g['skipped']}.", ""]
    lines = [*head,
             f"In process, on the in-place cache, {chain}: {g['rows']} rows of {g['prompt_tokens']}-token prompts, "
             f"{g['steps']} greedy steps a round, {g['rounds']} rounds alternating the variants; a step is timed from "
             f"the call to its logits in host memory (slots of {g['capacity']} tokens). Same tokens in every "
             f"variant: {'yes' if g['same_tokens'] else '**no**'}.", "",
             "| decode steps | ms/step p50 | p90 | tokens/s | vs ordinary |", "|---|---:|---:|---:|---:|"]
    for name, row in g["variants"].items():
        if row["status"] != "ok":
            lines.append(f"| {name} | not run: {row['reason']} | | | |")
            continue
        lines.append(f"| {name} | {row['step_ms_p50']:.3f} | {row['step_ms_p90']:.3f} | {row['tokens_per_s']:,.0f} "
                     f"| {row['vs_ordinary']:.2f}× |")
    return [*lines, ""]


def _cache_of(gen: dict[str, Any]) -> str:
    in_place = gen.get("kv_in_place")
    return "in-place cache" if in_place else "Concat cache" if in_place is False else "cache not recorded"


def _generation_fp16(gen: dict[str, Any] | None) -> list[str]:
    if not gen:
        return []
    return ["", f"### FP16 graph ({gen.get('model', 'fp16')}, workers on the {_cache_of(gen)})", "",
            *_generation(gen)]


def _transfers_in_place(t: dict[str, Any] | None) -> list[str]:
    if not t:
        return []
    if "skipped" in t:
        return ["", "### In-place cache (FP16 graph)", "",
                f"Not measured on this chain ({' → '.join(_short(p) for p in t['providers'])}): {t['skipped']}."]
    return ["", f"### In-place cache (FP16 graph, {t['dtype']} slots in {t['slots']} memory)", "", *_transfers(t)]
