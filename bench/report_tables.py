"""The tables of ``docs/benchmarks.md`` (:mod:`bench.report`): the seed's table per workload, latency under load,
the bare-loop limit, INT8 and the machine. Pure: results dict in, Markdown table out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.markdown import fmt, md_table, mib

__all__ = ["int8_table", "limit_at", "limit_table", "machine_table", "main_table", "open_loop_table"]

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
