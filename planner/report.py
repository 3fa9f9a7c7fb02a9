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


def plot_timeline(trace: Trace, rows: Sequence[tuple[str, GridRow]], path: Path) -> None:
    """Arrival rate, then replicas and requests waiting over the trace for each labelled setting."""
    plt = _pyplot()
    fig, axes = plt.subplots(1 + len(rows), 1, figsize=(9, 2.4 * (1 + len(rows))), sharex=True)
    bin_s = max(1.0, trace.duration_s / 600)
    starts, rate = trace.rate_per_s(bin_s)
    axes[0].plot(starts / 3600, rate, color="tab:blue", linewidth=0.8)
    axes[0].set_ylabel("arrivals / s")
    for ax, (label, row) in zip(axes[1:], rows, strict=True):
        times = [t / 3600 for t, _, _ in row.outcome.timeline]
        ax.step(times, [c for _, c, _ in row.outcome.timeline], where="post", color="tab:green")
        ax.set_ylabel("replicas", color="tab:green")
        twin = ax.twinx()
        twin.plot(times, [w for _, _, w in row.outcome.timeline], color="tab:red", linewidth=0.6)
        twin.set_ylabel("waiting", color="tab:red")
        s, o = row.scaler, row.outcome
        ax.set_title(f"{label}: listLength {s.list_length}, pollingInterval {s.polling_interval_s:g} s, "
                     f"minReplicas {s.min_replicas}; p99 {o.percentile_ms(99):,.0f} ms, "
                     f"{o.replica_minutes:,.0f} replica-min", fontsize=9)
    axes[-1].set_xlabel("hours")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
