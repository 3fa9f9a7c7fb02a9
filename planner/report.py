"""``fleet plan``'s outputs: a Markdown table, a JSON document and two plots (matplotlib, headless Agg)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from planner.grid import GridRow
from planner.trace import Trace

__all__ = ["markdown_table", "plot_grid", "plot_timeline"]


def markdown_table(rows: Sequence[GridRow], best: GridRow | None) -> str:
    """One line per setting; the chosen one in bold."""
    head = ("| listLength | pollingInterval s | minReplicas | p50 wait ms | p99 wait ms | refused (429) "
            "| replica-minutes | peak replicas |\n|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    lines = []
    for row in rows:
        j = row.to_json()
        cells = [str(j["list_length"]), f"{j['polling_interval_s']:g}", str(j["min_replicas"]),
                 f"{j['p50_queue_wait_ms']:,.1f}", f"{j['p99_queue_wait_ms']:,.1f}", f"{j['refused']:,}",
                 f"{j['replica_minutes']:,.1f}", str(j["peak_replicas"])]
        if row is best:
            cells = [f"**{c}**" for c in cells]
        lines.append("| " + " | ".join(cells) + " |")
    return head + "\n".join(lines) + "\n"


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_grid(rows: Sequence[GridRow], best: GridRow | None, slo_p99_ms: float, path: Path) -> None:
    """Cost (replica-minutes) against p99 queue wait, one point per setting, the SLO as a line."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    markers = {low: m for low, m in zip(sorted({r.scaler.min_replicas for r in rows}), "os^Dv", strict=False)}
    lengths = sorted({r.scaler.list_length for r in rows})
    cmap = plt.get_cmap("viridis", max(2, len(lengths)))
    for row in rows:
        o = row.outcome
        ax.scatter(o.replica_minutes, max(o.percentile_ms(99), 0.1), marker=markers.get(row.scaler.min_replicas, "o"),
                   color=cmap(lengths.index(row.scaler.list_length)), s=20 + 6 * row.scaler.polling_interval_s,
                   edgecolors="red" if row is best else "none", linewidths=2)
    ax.axhline(slo_p99_ms, color="grey", linestyle="--", label=f"p99 SLO {slo_p99_ms:g} ms")
    for length in lengths:
        ax.scatter([], [], color=cmap(lengths.index(length)), label=f"listLength {length}")
    for low, m in markers.items():
        ax.scatter([], [], color="black", marker=m, label=f"minReplicas {low}")
    ax.set_yscale("log")
    ax.set_xlabel("replica-minutes over the trace")
    ax.set_ylabel("p99 queue wait (ms, log)")
    ax.set_title("fleet plan: cost vs p99 queue wait (marker size = pollingInterval; red edge = chosen)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_timeline(trace: Trace, row: GridRow, path: Path) -> None:
    """Arrival rate, replicas and queue length over the trace for one setting."""
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
    bin_s = max(1.0, trace.duration_s / 600)
    starts, rate = trace.rate_per_s(bin_s)
    top.plot(starts / 3600, rate, color="tab:blue", linewidth=0.8)
    top.set_ylabel("arrivals / s")
    times = [t / 3600 for t, _, _ in row.outcome.timeline]
    bottom.step(times, [c for _, c, _ in row.outcome.timeline], where="post", color="tab:green", label="replicas")
    twin = bottom.twinx()
    twin.plot(times, [w for _, _, w in row.outcome.timeline], color="tab:red", linewidth=0.6, label="waiting")
    twin.set_ylabel("requests waiting", color="tab:red")
    bottom.set_ylabel("replicas", color="tab:green")
    bottom.set_xlabel("hours")
    s = row.scaler
    top.set_title(f"listLength {s.list_length}, pollingInterval {s.polling_interval_s:g} s, minReplicas "
                  f"{s.min_replicas}, cooldown {s.cooldown_s:g} s, start {s.start_s:g} s")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
