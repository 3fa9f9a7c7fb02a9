"""Traffic traces: arrival times (s from the start) and optional prompt lengths (tokens).

Sources: a CSV file (header with ``arrival_s`` and optionally ``prompt_tokens``), a JSONL file (one
object a line with the same keys), a Poisson process, or a diurnal curve (one trough → peak → trough
cycle over the trace) with bursts. Generated traces come from a seeded numpy generator.

Raises :class:`TraceError` (a ``ValueError``) naming the field, the line and the limit that was broken.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

__all__ = ["Burst", "Trace", "TraceError", "diurnal", "load_trace", "parse_burst", "poisson"]

MAX_REQUESTS = 20_000_000
"""Refuse traces larger than this (requests): the simulator holds the whole trace in memory."""


class TraceError(ValueError):
    """A trace file or generator argument is malformed; the message names the field and the limit."""


@dataclass(frozen=True)
class Trace:
    """Sorted arrival times and the trace's length."""

    arrival_s: npt.NDArray[np.float64]
    """Seconds from the trace's start, ascending."""
    duration_s: float
    """Length of the trace (s); at least the last arrival."""
    prompt_tokens: npt.NDArray[np.int64] | None = None
    """Prompt length per request (tokens), or None when the source has none."""

    def __len__(self) -> int:
        return int(self.arrival_s.size)

    def rate_per_s(self, bin_s: float) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """Arrivals per second in bins of ``bin_s`` seconds: (bin starts s, rates req/s)."""
        bins = max(1, math.ceil(self.duration_s / bin_s))
        counts, edges = np.histogram(self.arrival_s, bins=bins, range=(0.0, bins * bin_s))
        return edges[:-1], counts / bin_s


@dataclass(frozen=True)
class Burst:
    """A window where the rate is multiplied: ``start_s`` for ``duration_s`` seconds, times ``multiplier``."""

    start_s: float
    duration_s: float
    multiplier: float


def parse_burst(text: str) -> Burst:
    """``START_S:DURATION_S:MULTIPLIER`` (e.g. ``3600:120:4``) as a :class:`Burst`."""
    parts = text.split(":")
    try:
        start_s, duration_s, multiplier = (float(p) for p in parts)
    except ValueError as exc:
        raise TraceError(f"--burst {text!r}: expected START_S:DURATION_S:MULTIPLIER (three numbers)") from exc
    if start_s < 0 or duration_s <= 0 or multiplier <= 0:
        raise TraceError(f"--burst {text!r}: start_s must be >= 0, duration_s and multiplier > 0")
    return Burst(start_s, duration_s, multiplier)


def _checked(arrivals: list[float], tokens: list[int] | None, source: str) -> Trace:
    if not arrivals:
        raise TraceError(f"{source}: no requests (need at least 1 arrival_s)")
    order = np.argsort(np.asarray(arrivals, dtype=np.float64), kind="stable")
    arrival_s = np.asarray(arrivals, dtype=np.float64)[order]
    toks = None if tokens is None else np.asarray(tokens, dtype=np.int64)[order]
    return Trace(arrival_s - min(0.0, float(arrival_s[0])), float(arrival_s[-1]), toks)


def _row(values: dict[str, object], where: str) -> tuple[float, int | None]:
    if "arrival_s" not in values:
        raise TraceError(f"{where}: field 'arrival_s' is missing")
    try:
        arrival = float(values["arrival_s"])  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise TraceError(f"{where}: field 'arrival_s' must be a number of seconds, "
                         f"got {values['arrival_s']!r}") from exc
    if not math.isfinite(arrival) or arrival < 0:
        raise TraceError(f"{where}: field 'arrival_s' must be finite and >= 0, got {arrival}")
    raw = values.get("prompt_tokens")
    if raw in (None, ""):
        return arrival, None
    try:
        tokens = int(raw)  # type: ignore[call-overload]
    except (TypeError, ValueError) as exc:
        raise TraceError(f"{where}: field 'prompt_tokens' must be an integer, got {raw!r}") from exc
    if tokens < 1:
        raise TraceError(f"{where}: field 'prompt_tokens' must be >= 1, got {tokens}")
    return arrival, tokens


def load_trace(path: Path) -> Trace:
    """Read a ``.csv`` or ``.jsonl`` trace (see the module docstring)."""
    arrivals: list[float] = []
    tokens: list[int | None] = []
    with path.open(newline="") as handle:
        if path.suffix == ".csv":
            rows: list[tuple[int, dict[str, object]]] = [(i + 2, dict(r)) for i, r in enumerate(csv.DictReader(handle))]
        elif path.suffix in (".jsonl", ".ndjson"):
            rows = []
            for i, line in enumerate(handle, start=1):
                if line.strip():
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise TraceError(f"{path}:{i}: not JSON ({exc.msg})") from exc
                    if not isinstance(obj, dict):
                        raise TraceError(f"{path}:{i}: expected an object with field 'arrival_s'")
                    rows.append((i, obj))
        else:
            raise TraceError(f"{path}: trace files are .csv or .jsonl, got {path.suffix!r}")
    for line_no, values in rows:
        if len(arrivals) >= MAX_REQUESTS:
            raise TraceError(f"{path}: more than {MAX_REQUESTS} requests (the limit)")
        arrival, tok = _row(values, f"{path}:{line_no}")
        arrivals.append(arrival)
        tokens.append(tok)
    have = [t for t in tokens if t is not None]
    if have and len(have) != len(tokens):
        raise TraceError(f"{path}: field 'prompt_tokens' is set on some rows only ({len(have)} of {len(tokens)})")
    return _checked(arrivals, [t for t in tokens if t is not None] if have else None, str(path))


def _multiplier(t: npt.NDArray[np.float64], bursts: tuple[Burst, ...]) -> npt.NDArray[np.float64]:
    mult = np.ones_like(t)
    for b in bursts:
        mult = np.where((t >= b.start_s) & (t < b.start_s + b.duration_s), mult * b.multiplier, mult)
    return mult


_Rate = Callable[[npt.NDArray[np.float64]], npt.NDArray[np.float64]]


def _generate(base_rps: float | _Rate, top_rps: float, duration_s: float, bursts: tuple[Burst, ...],
              seed: int) -> Trace:
    """Non-homogeneous Poisson arrivals by thinning: candidates at the top rate, kept with rate(t)/top."""
    if duration_s <= 0:
        raise TraceError(f"duration must be > 0 s, got {duration_s}")
    ceiling = top_rps * max([1.0, *(b.multiplier for b in bursts)])
    expected = ceiling * duration_s
    if expected > MAX_REQUESTS:
        raise TraceError(f"the trace would hold ~{expected:.0f} requests; the limit is {MAX_REQUESTS}")
    rng = np.random.default_rng(seed)
    candidates = np.sort(rng.uniform(0.0, duration_s, rng.poisson(expected)))
    rate = base_rps(candidates) if callable(base_rps) else np.full_like(candidates, float(base_rps))
    keep = rng.uniform(0.0, 1.0, candidates.size) * ceiling < rate * _multiplier(candidates, bursts)
    arrivals = candidates[keep]
    if arrivals.size == 0:
        raise TraceError("the generated trace is empty: raise the rate or the duration")
    return Trace(arrivals, duration_s)


def poisson(rate_rps: float, duration_s: float, *, bursts: tuple[Burst, ...] = (), seed: int = 0) -> Trace:
    """Poisson arrivals at ``rate_rps`` requests/s for ``duration_s`` s, with ``bursts``."""
    if rate_rps <= 0:
        raise TraceError(f"rate must be > 0 requests/s, got {rate_rps}")
    return _generate(rate_rps, rate_rps, duration_s, bursts, seed)


def diurnal(hours: float, peak_rps: float, *, trough_rps: float | None = None, bursts: tuple[Burst, ...] = (),
            seed: int = 0) -> Trace:
    """One day-shaped cycle over ``hours``: ``trough_rps`` (default peak/10) at both ends, ``peak_rps`` midway."""
    if hours <= 0 or peak_rps <= 0:
        raise TraceError(f"--hours and --peak-rps must be > 0, got {hours} and {peak_rps}")
    trough = peak_rps / 10 if trough_rps is None else trough_rps
    if not 0 <= trough <= peak_rps:
        raise TraceError(f"--trough-rps must be between 0 and --peak-rps ({peak_rps}), got {trough}")
    duration_s = hours * 3600.0

    def rate(t: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        return trough + (peak_rps - trough) * (1.0 - np.cos(2.0 * np.pi * t / duration_s)) / 2.0

    return _generate(rate, peak_rps, duration_s, bursts, seed)
