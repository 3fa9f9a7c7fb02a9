"""The soak's figures, pure: samples in, plateau verdicts and a Markdown report out (no Redis, no processes).

A :class:`Sample` is one 10-second reading of every process (RSS, open file descriptors), of Redis
(``used_memory``, keys by prefix) and of the outcomes so far. :func:`plateau` compares the mean of
the last third of a series with the mean of its middle third: the first third is warm-up (allocator
arenas, ORT's first batches, Celery's caches), and a leak shows as the last third above the middle.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Plateau", "Sample", "key_prefix", "plateau", "render_markdown", "render_plot"]

PLATEAU_TOLERANCE = 0.05
"""A series is flat when its last third's mean is at most 5 % above its middle third's ..."""
PLATEAU_SLACK_BYTES = 4 * 1024 * 1024
"""... or at most 4 MiB above it (small processes jitter by more than 5 % on allocator noise)."""


@dataclass(frozen=True)
class Sample:
    """One reading, ``t_s`` seconds after the traffic began."""

    t_s: float
    rss_bytes: Mapping[str, int]
    open_fds: Mapping[str, int]
    redis_used_memory_bytes: int
    keys_by_prefix: Mapping[str, int]
    outcomes: Mapping[str, int]


@dataclass(frozen=True)
class Plateau:
    """Mean of the middle and last thirds of one series, and whether it stopped growing."""

    name: str
    first: float
    middle_mean: float
    last_mean: float
    peak: float
    last_slope_per_min: float = 0.0
    """Least-squares slope of the last third (units per minute): near 0 once settled."""

    @property
    def growth(self) -> float:
        """(last - middle) / middle; 0 for an empty middle."""
        return (self.last_mean - self.middle_mean) / self.middle_mean if self.middle_mean else 0.0

    def flat(self, *, tolerance: float = PLATEAU_TOLERANCE, slack: float = PLATEAU_SLACK_BYTES) -> bool:
        """True when the last third is within ``tolerance`` (relative) or ``slack`` (absolute) of the middle."""
        return self.growth <= tolerance or self.last_mean - self.middle_mean <= slack


def _slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    if len(xs) < 2:
        return 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


def plateau(name: str, values: Sequence[float], times_s: Sequence[float] | None = None) -> Plateau:
    """Thirds of ``values`` (at least 3 readings), taken at ``times_s`` (default: one per minute).

    Raises:
        ValueError: fewer than 3 values.
    """
    if len(values) < 3:
        raise ValueError(f"{name}: a plateau needs at least 3 readings, got {len(values)}")
    third = len(values) // 3
    middle = values[third : 2 * third]
    last = values[2 * third :]
    times = list(times_s) if times_s is not None else [60.0 * i for i in range(len(values))]
    slope = 60.0 * _slope(times[2 * third :], last)
    return Plateau(name, float(values[0]), statistics.fmean(middle), statistics.fmean(last), float(max(values)), slope)


def key_prefix(key: str) -> str:
    """The family a Redis key belongs to: ``celery-task-meta-*``, ``fleet:req:*``, ``fleet:worker:*``, ..."""
    if key.startswith("celery-task-meta-"):
        return "celery-task-meta-*"
    if key.startswith("_kombu."):
        return "_kombu.*"
    parts = key.split(":")
    if parts[0] == "fleet" and len(parts) >= 3:
        if parts[1] == "model":
            return "fleet:model:*:" + parts[-1]
        return f"fleet:{parts[1]}:*"
    return key


@dataclass
class SoakRun:
    """Everything the report shows: the samples and the end-of-run checks."""

    minutes: float
    rate_per_s: float
    samples: list[Sample]
    outcomes: dict[str, int]
    lost: list[str] = field(default_factory=list)
    leftover_keys: list[str] = field(default_factory=list)
    permanent_keys: list[str] = field(default_factory=list)
    processes: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    ledger: dict[str, Any] = field(default_factory=dict)
    """:meth:`tools.ledger.LedgerReport.as_dict` of the run's end (empty when the ledger was not run)."""


def _mib(n: float) -> str:
    return f"{n / 1048576:.1f}"


def plateaus(run: SoakRun) -> list[Plateau]:
    """One plateau per process RSS series, one for Redis ``used_memory`` (needs 3+ samples)."""
    names = sorted({name for s in run.samples for name in s.rss_bytes})
    times = [s.t_s for s in run.samples]
    out = [plateau(f"RSS {n}", [float(s.rss_bytes.get(n, 0)) for s in run.samples], times) for n in names]
    out.append(plateau("Redis used_memory", [float(s.redis_used_memory_bytes) for s in run.samples], times))
    return out


def render_markdown(run: SoakRun, plot_path: str | None) -> str:
    """The report: setup, outcomes, the plateau table with its verdicts, fds, keys, leftover keys."""
    lines = [
        "# Soak: the fleet under mixed traffic for a long time",
        "",
        f"{run.minutes:g} minutes at a bounded {run.rate_per_s:g} requests/s of mixed traffic, written by "
        f"`fleet soak --minutes {run.minutes:g}` (see `bench/soak.py`). Every 10 s it reads the RSS and open file "
        "descriptors of each process (psutil), Redis `used_memory` and its keys by prefix (SCAN), and the outcomes "
        "so far.",
        "",
        "Processes: " + ", ".join(f"**{k}** ({v})" for k, v in run.processes.items()) + ".",
        "",
    ]
    if plot_path:
        lines += [f"![soak: RSS, file descriptors, Redis memory and keys over time]({plot_path})", ""]
    lines += ["## Outcomes", "", "| outcome | count |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in sorted(run.outcomes.items())]
    lines += ["", f"**Lost** (accepted, no result and no error after the drain): {len(run.lost)}"]
    lines += [f"- `{rid}`" for rid in run.lost[:20]]
    if run.ledger:
        broken = run.ledger.get("violations_by_kind") or {}
        verdict = "every promise held" if not broken else "broken: " + ", ".join(f"{k} {v}" for k, v in broken.items())
        lines += ["", f"**Ledger** (`tools/ledger.py`: every accepted ID terminal, no stored result changed, every "
                  f"stream ended, nothing left queued, unacked or held): {run.ledger.get('accepted', 0)} accepted, "
                  + verdict]
    if len(run.samples) >= 3:
        rows = plateaus(run)
        lines += [
            "",
            "## Memory: plateau",
            "",
            "Mean of the middle third of the samples against the mean of the last third (the first third is "
            f"warm-up). Flat: the last third is at most {PLATEAU_TOLERANCE:.0%} or "
            f"{_mib(PLATEAU_SLACK_BYTES)} MiB above the middle.",
            "",
            "| series | first (MiB) | middle third (MiB) | last third (MiB) | peak (MiB) | growth "
            "| last-third slope (MiB/min) | verdict |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for p in rows:
            verdict = "plateau" if p.flat() else "**still growing**"
            lines.append(
                f"| {p.name} | {_mib(p.first)} | {_mib(p.middle_mean)} | {_mib(p.last_mean)} | {_mib(p.peak)} "
                f"| {p.growth:+.1%} | {p.last_slope_per_min / 1048576:+.2f} | {verdict} |"
            )
        first, last = run.samples[0], run.samples[-1]
        lines += ["", "## Open file descriptors", "", "| process | first | last | max |", "|---|---|---|---|"]
        for name in sorted(last.open_fds):
            series = [s.open_fds.get(name, 0) for s in run.samples]
            lines.append(f"| {name} | {first.open_fds.get(name, 0)} | {last.open_fds[name]} | {max(series)} |")
        prefixes = sorted({p for s in run.samples for p in s.keys_by_prefix})
        lines += ["", "## Redis keys by prefix", "", "| prefix | first | middle | last | max |",
                  "|---|---|---|---|---|"]
        mid = run.samples[len(run.samples) // 2]
        for prefix in prefixes:
            counts = [s.keys_by_prefix.get(prefix, 0) for s in run.samples]
            lines.append(
                f"| `{prefix}` | {first.keys_by_prefix.get(prefix, 0)} | {mid.keys_by_prefix.get(prefix, 0)} "
                f"| {last.keys_by_prefix.get(prefix, 0)} | {max(counts)} |"
            )
    lines += [
        "",
        "## Keys without a TTL",
        "",
        "After the traffic stopped and every request had finished, every key with TTL -1 was listed. "
        "Expected permanent keys (queues, kombu's bindings, model cards, the dead-letter list): "
        + (", ".join(f"`{k}`" for k in run.permanent_keys) or "none")
        + ".",
        "",
        f"**Keys a finished request left without a TTL: {len(run.leftover_keys)}**"
        + ("" if not run.leftover_keys else ": " + ", ".join(f"`{k}`" for k in run.leftover_keys[:30])),
    ]
    if run.notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in run.notes]
    return "\n".join(lines) + "\n"


def render_plot(run: SoakRun, path: Path) -> None:
    """Three panels over time: RSS per process, open fds per process, Redis memory and key counts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s.t_s / 60 for s in run.samples]
    fig, axes = plt.subplots(3, 1, figsize=(9, 10), sharex=True)
    names = sorted({n for s in run.samples for n in s.rss_bytes})
    for n in names:
        axes[0].plot(t, [s.rss_bytes.get(n, 0) / 1048576 for s in run.samples], label=n)
        axes[1].plot(t, [s.open_fds.get(n, 0) for s in run.samples], label=n)
    axes[0].set_ylabel("RSS (MiB)")
    axes[0].legend(fontsize=7, loc="upper left")
    axes[1].set_ylabel("open fds")
    axes[1].legend(fontsize=7, loc="upper left")
    ax = axes[2]
    ax.plot(t, [s.redis_used_memory_bytes / 1048576 for s in run.samples], color="black", label="used_memory")
    ax.set_ylabel("Redis used_memory (MiB)")
    ax2 = ax.twinx()
    for p in sorted({p for s in run.samples for p in s.keys_by_prefix}):
        series = [s.keys_by_prefix.get(p, 0) for s in run.samples]
        if max(series) >= 5:
            ax2.plot(t, series, linestyle="--", label=p)
    ax2.set_ylabel("keys")
    ax2.legend(fontsize=7, loc="upper left")
    ax.set_xlabel("minutes")
    fig.suptitle(f"fleet soak: {run.minutes:g} min at {run.rate_per_s:g} req/s")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
