"""The model-lifecycle part of ``fleet status``: per model, the versions in force, the canary's
queue, the last changes and the workers' last refusals (:mod:`protocol.model_state`), and whether
the live workers serve the desired versions: ``not_served`` says plainly when they do not (a
refused pin, a worker not yet switched), and a refusal the state has moved past is marked
``superseded``. ``fleet models pin`` and ``fleet models canary`` wait for it (:func:`await_served`) and
print the same served / not-served verdict."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import redis

from broker import pipe_waiting_counts
from protocol.model_state import (
    AUTO_ROLLBACKS_KEY,
    HISTORY_KEY,
    REFUSALS_KEY,
    STATE_KEY,
    HistoryEntry,
    ModelState,
    Refusal,
)
from protocol.settings import FleetSettings

__all__ = [
    "LAST_ENTRIES",
    "await_served",
    "canary_served_by",
    "format_model_states",
    "model_states",
    "not_served",
    "served_by",
    "settled",
    "superseded_by",
]

POLL_S = 0.2
"""How often :func:`await_served` re-reads the heartbeats and refusals (s)."""

LAST_ENTRIES = 3
"""History entries and refusals shown per model."""


def _hosts_by(workers: list[dict[str, Any]], model: str, field: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for w in workers:
        if w.get("model") == model and w.get(field):
            out.setdefault(str(w[field]), []).append(str(w.get("hostname")))
    return {v: sorted(hosts) for v, hosts in sorted(out.items())}


def served_by(workers: list[dict[str, Any]], model: str) -> dict[str, list[str]]:
    """Stable version -> the hostnames of ``model``'s live workers serving it (from heartbeats), pure.
    Every live worker serves some stable version, so it is empty exactly when none of them runs."""
    return _hosts_by(workers, model, "version")


def canary_served_by(workers: list[dict[str, Any]], model: str) -> dict[str, list[str]]:
    """Canary version -> the hostnames of ``model``'s live workers that have it loaded (the heartbeats'
    ``canary_version``), pure. A worker with no canary loaded is not listed: its canary queue runs on its
    stable version (:func:`not_served` says so)."""
    return _hosts_by(workers, model, "canary_version")


def _refused_by(refused: list[Refusal], version: str, since_unix_s: float) -> str:
    latest = {r.worker: r for r in refused if r.version == version and r.at_unix_s >= since_unix_s}
    if not latest:
        return ""
    return "; refused by " + ", ".join(f"{w} ({r.error_type})" for w, r in sorted(latest.items()))


def not_served(
    model: str, state: ModelState | None, configured: str | None, workers: list[dict[str, Any]],
    refused: list[Refusal],
) -> str | None:
    """A plain sentence when ``model``'s live workers do not all serve the desired versions, else None (pure).

    The desired stable version is the pinned one, else ``configured`` (the model's ``store_version``;
    None = a model file, whose version label is not compared). ``refused`` adds who refused it since
    the last change.
    """
    mine = [w for w in workers if w.get("model") == model]
    if not mine:  # with no state either, nothing was asked beyond the config (readiness says "no worker")
        return None if state is None else f"no live worker serves {model}"
    since = state.changed_at_unix_s if state is not None else 0.0
    problems = []
    stable = (state.stable if state is not None else None) or configured
    if stable is not None:
        served = served_by(mine, model)
        others = {v: hosts for v, hosts in served.items() if v != stable}
        if others:
            serving = "; ".join(f"{', '.join(hosts)} serve{'s' if len(hosts) == 1 else ''} {v}"
                                for v, hosts in others.items())
            which = "every" if stable in served else "any"
            problems.append(f"desired stable {stable} is not served by {which} worker: {serving}"
                            f"{_refused_by(refused, stable, since)}")
    canary = state.canary if state is not None else None
    if canary is not None:
        without = [w for w in mine if w.get("canary_version") != canary]
        if without:
            hosts = ", ".join(sorted(str(w.get("hostname")) for w in without))
            problems.append(f"canary {canary} is not loaded by {hosts} ({_canary_queue_runs_on(without)})"
                            f"{_refused_by(refused, canary, since)}")
    return "; ".join(problems) or None


def _canary_queue_runs_on(workers: list[dict[str, Any]]) -> str:
    """What the canary queue of ``workers`` (which lack the desired canary) runs on, from their heartbeats:
    the canary each still holds, else its stable version."""
    runs: dict[str, list[str]] = {}
    for w in workers:
        held = w.get("canary_version")
        what = f"{held} (a canary the state no longer names)" if held else f"stable {w.get('version')}"
        runs.setdefault(what, []).append(str(w.get("hostname")))
    if len(runs) == 1:
        return f"their canary queue runs on {next(iter(runs))}"
    return "the canary queue runs on " + "; ".join(f"{what} at {', '.join(sorted(hosts))}"
                                                    for what, hosts in sorted(runs.items()))


def settled(state: ModelState | None, configured: str | None, workers: list[dict[str, Any]],
            refused: list[Refusal]) -> bool:
    """Every live worker of the state's model serves the desired versions or has refused them since the
    last change (pure): nothing more will happen without another change."""
    if state is None:
        return True
    since = state.changed_at_unix_s
    done = {(r.worker, r.version) for r in refused if r.at_unix_s >= since}
    stable = state.stable or configured
    for w in workers:
        if w.get("model") != state.model:
            continue
        host = str(w.get("hostname"))
        if stable is not None and w.get("version") != stable and (host, stable) not in done:
            return False
        if state.canary is not None and w.get("canary_version") != state.canary and (host, state.canary) not in done:
            return False
    return True


def await_served(settings: FleetSettings, client: redis.Redis[bytes], model: str, wait_s: float) -> dict[str, Any]:
    """Wait up to ``wait_s`` seconds (monotonic; 0 = one read) for ``model``'s live workers to apply its state
    (serve it, or refuse it: :func:`settled`), then say what they serve: ``{"served": {stable version: [hosts]},
    "canary_served": {canary version: [hosts]}, "not_served": sentence | None}``."""
    from producer.registry import pipe_list_workers

    configured = settings.models[model].store_version
    deadline = time.monotonic() + max(0.0, wait_s)
    while True:  # each read: the heartbeat keys' SCAN, then one pipeline (2 round trips)
        with client.pipeline(transaction=False) as pipe:
            workers_of = pipe_list_workers(client, pipe)
            reads_of = _queue_model_reads(pipe, model)
            replies = iter(pipe.execute())
        workers, reads = workers_of(replies), reads_of(replies)
        state, refused = reads.state, reads.refused
        if settled(state, configured, workers, refused) or time.monotonic() >= deadline:
            break
        time.sleep(POLL_S)  # polling heartbeats under a deadline: a CLI waiting for other processes
    return {"served": served_by(workers, model), "canary_served": canary_served_by(workers, model),
            "not_served": not_served(model, state, configured, workers, refused)}


def superseded_by(refusal: Refusal, state: ModelState | None, configured: str | None,
                  workers: list[dict[str, Any]]) -> str | None:
    """Why ``refusal`` no longer describes the fleet (None while it still does), pure: the state no longer
    names its version, or the worker that refused it now serves it."""
    stable = (state.stable if state is not None else None) or configured
    canary = state.canary if state is not None else None
    if refusal.version not in (stable, canary):
        now = f"{stable or '(configured)'}" + (f" + canary {canary}" if canary else "")
        return f"the desired state is now {now}"
    for w in workers:
        if w.get("hostname") == refusal.worker and refusal.version in (w.get("version"), w.get("canary_version")):
            return f"{refusal.worker} now serves {refusal.version}"
    return None


def model_states(settings: FleetSettings, client: redis.Redis[bytes],
                 workers: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """One JSON-friendly row per configured model (the ``models`` part of ``fleet status --json``).

    ``workers``: the live workers' heartbeats when the caller has read them already (``fleet status`` passes
    :func:`producer.registry.read_fleet_state`'s, so its tables and these rows show one reading); None reads them
    here (:func:`producer.registry.pipe_list_workers`: its ``SCAN``, then an ``MGET`` in the pipeline below).

    Round trips, however many models: one pipeline reads every model's state, auto-rollback count, last changes
    and refusals, and every canary queue's waiting requests (one script, ``EVAL``), and the heartbeats when
    ``workers`` is None, after their keys' ``SCAN`` (2 in all). Before, each model cost 6 of its own: 122 for 20
    models, of the 125 of a ``fleet status``, which takes 4 now.

    Raises:
        redis.RedisError: Redis fails (``fleet status`` reads the fleet state first and skips this when it cannot).
        pydantic.ValidationError: a stored state, history entry or refusal is not the JSON this fleet writes.
    """
    from producer.registry import pipe_list_workers

    canary_queues = {model: settings.canary_queue_for(model) for model in settings.models}
    with client.pipeline(transaction=False) as pipe:
        workers_of = pipe_list_workers(client, pipe) if workers is None else None
        waiting_of = pipe_waiting_counts(pipe, list(canary_queues.values()))
        reads_of = {model: _queue_model_reads(pipe, model) for model in settings.models}
        replies = iter(pipe.execute())
    workers = workers_of(replies) if workers_of is not None else workers or []
    waiting = waiting_of(replies)
    rows = []
    for model, read in reads_of.items():
        reads, configured = read(replies), settings.models[model].store_version
        state = reads.state
        rows.append({
            "model": model,
            "stable": state.stable if state else None,
            "canary": state.canary if state else None,
            "canary_weight": state.canary_weight if state else 0,
            "stable_manifest_sha256": state.stable_manifest_sha256 if state else None,
            "canary_manifest_sha256": state.canary_manifest_sha256 if state else None,
            "generation": state.generation if state else 0,
            "canary_queue": canary_queues[model],
            "canary_queue_depth": waiting[canary_queues[model]].requests,
            "auto_rollbacks": reads.auto_rollbacks,
            "last_changes": [e.model_dump(mode="json", by_alias=True) for e in reads.last_changes],
            "served": served_by(workers, model),
            "not_served": not_served(model, state, configured, workers, reads.refused),
            "last_refusals": [{**r.model_dump(mode="json"), "superseded": superseded_by(r, state, configured, workers)}
                              for r in reads.refused[-LAST_ENTRIES:]],
        })
    return rows


@dataclass(frozen=True)
class _ModelReads:
    """What :func:`model_states`'s pipeline read for one model."""

    state: ModelState | None
    auto_rollbacks: int
    last_changes: list[HistoryEntry]
    """The last :data:`LAST_ENTRIES` history entries, oldest first."""
    refused: list[Refusal]
    """Every recorded refusal (at most :data:`~protocol.model_state.REFUSALS_KEEP`), oldest first."""


def _queue_model_reads(pipe: redis.client.Pipeline[bytes], model: str) -> Callable[[Iterator[Any]], _ModelReads]:
    """Queue ``model``'s state, auto-rollback counter, last history entries and refusals on ``pipe`` (what
    :func:`~protocol.model_state.read_state`, :func:`~protocol.model_state.history` and
    :func:`~protocol.model_state.refusals` read); returns what parses their replies, read in that order from the
    iterator over ``pipe.execute()``'s replies."""
    pipe.get(STATE_KEY.format(model=model))
    pipe.get(AUTO_ROLLBACKS_KEY.format(model=model))
    pipe.lrange(HISTORY_KEY.format(model=model), -LAST_ENTRIES, -1)
    pipe.lrange(REFUSALS_KEY.format(model=model), 0, -1)  # all: not_served names every refusal since the change

    def read(replies: Iterator[Any]) -> _ModelReads:
        state_raw, autos_raw, changes_raw, refused_raw = (next(replies) for _ in range(4))
        return _ModelReads(
            state=None if state_raw is None else ModelState.model_validate_json(state_raw),
            auto_rollbacks=int(autos_raw or 0),
            last_changes=[HistoryEntry.model_validate_json(raw) for raw in changes_raw],
            refused=[Refusal.model_validate_json(raw) for raw in refused_raw],
        )

    return read


def _ago(at_unix_s: float, now_s: float) -> str:
    seconds = max(0.0, now_s - at_unix_s)
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    return f"{seconds / 60:.0f} min ago" if seconds < 7200 else f"{seconds / 3600:.1f} h ago"


def _split(doc: dict[str, Any]) -> str:
    """``stable + canary C W%``, each pinned version with its manifest digest's first 12 hex digits (``@…``)."""
    def pinned(version: str, role: str) -> str:
        digest = doc.get(f"{role}_manifest_sha256")
        return f"{version} @{digest[:12]}" if digest else version

    stable = pinned(doc.get("stable") or "(configured)", "stable")
    if not doc.get("canary"):
        return stable
    return f"{stable} + canary {pinned(doc['canary'], 'canary')} {doc['canary_weight']}%"


def format_model_states(rows: list[dict[str, Any]], now_s: float | None = None) -> list[str]:
    """The MODEL VERSIONS section of the human ``fleet status``."""
    now = time.time() if now_s is None else now_s
    lines = ["MODEL VERSIONS"]
    for row in rows:
        queue = f", canary queue {row['canary_queue']} depth {row['canary_queue_depth']}" if row["canary"] else ""
        autos = f", auto-rollbacks {row['auto_rollbacks']}" if row["auto_rollbacks"] else ""
        lines.append(f"{row['model']}: {_split(row)} (generation {row['generation']}{queue}{autos})")
        if row.get("served"):
            lines.append("  served: " + "; ".join(f"{v} by {', '.join(h)}" for v, h in row["served"].items()))
        if row.get("not_served"):
            lines.append(f"  NOT SERVED: {row['not_served']}")
        for e in row["last_changes"]:
            why = f": {e['reason']}" if e.get("reason") else ""
            lines.append(f"  {_ago(e['at_unix_s'], now)}  {e['action']} by {e['by']}  {_split(e['from'])} -> "
                         f"{_split(e['to'])}{why}")
        for r in row["last_refusals"]:
            mark = f" (superseded: {r['superseded']})" if r.get("superseded") else ""
            lines.append(f"  REFUSED{mark} {_ago(r['at_unix_s'], now)}  {r['worker']} refused {r['version']}: "
                         f"{r['error_type']}: {r['error']}")
    return lines
