"""PNG plots of p50/p99 latency against achieved QPS (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["latency_points", "plot_latency_vs_qps"]

SERIES = (("baseline", "tab:gray"), ("batching", "tab:blue"), ("int8", "tab:green"), ("peer", "tab:red"))


def latency_points(entry: dict[str, Any]) -> list[tuple[float, float, float]]:
    """(achieved QPS, p50 ms, p99 ms) of one configuration's workload, sorted by QPS.

    Points: the lone client, each open-loop rate, and saturation.
    """
    summaries = [entry["lone"], *[p["summary"] for p in entry["open"]], entry["saturation"]]
    pts = [
        (float(s["qps"]), float(s["latency"]["p50_ms"]), float(s["latency"]["p99_ms"]))
        for s in summaries
        if s["requests"] > 0
    ]
    return sorted(pts)


def plot_latency_vs_qps(results: dict[str, Any], workload: str, path: Path) -> Path:
    """Draw p50 (solid) and p99 (dashed) vs QPS for baseline, batching, INT8 and the peer.

    Returns ``path`` (a PNG).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=110)
    for key, color in SERIES:
        row = results["rows"].get(key, {})
        if row.get("status") != "ok":
            continue
        pts = latency_points(row["workloads"][workload])
        qps = [p[0] for p in pts]
        ax.plot(qps, [p[1] for p in pts], "o-", color=color, label=f"{key} p50")
        ax.plot(qps, [p[2] for p in pts], "s--", color=color, alpha=0.7, label=f"{key} p99")
    ax.set_yscale("log")
    from matplotlib.ticker import ScalarFormatter

    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(ScalarFormatter())
    ax.tick_params(axis="y", which="minor", labelsize=7)
    ax.set_xlabel("achieved throughput (requests/s)")
    ax.set_ylabel("latency, submit → result (ms)")
    model = results["meta"]["model"]["name"]
    ax.set_title(f"{model}, {workload} prompts: latency vs throughput")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
