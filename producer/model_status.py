"""The model-lifecycle part of ``fleet status``: per model, the versions in force, the canary's
queue, the last changes and the workers' last refusals (:mod:`protocol.model_state`)."""

from __future__ import annotations

import time
from typing import Any

import redis

from protocol.model_state import AUTO_ROLLBACKS_KEY, history, read_state, refusals
from protocol.settings import FleetSettings

__all__ = ["LAST_ENTRIES", "format_model_states", "model_states"]

LAST_ENTRIES = 3
"""History entries and refusals shown per model."""


def model_states(settings: FleetSettings, client: redis.Redis[bytes]) -> list[dict[str, Any]]:
    """One JSON-friendly row per configured model (the ``models`` part of ``fleet status --json``)."""
    rows = []
    for model in settings.models:
        state = read_state(client, model)
        canary_queue = settings.canary_queue_for(model)
        rows.append({
            "model": model,
            "stable": state.stable if state else None,
            "canary": state.canary if state else None,
            "canary_weight": state.canary_weight if state else 0,
            "generation": state.generation if state else 0,
            "canary_queue": canary_queue,
            "canary_queue_depth": int(client.llen(canary_queue)),
            "auto_rollbacks": int(client.get(AUTO_ROLLBACKS_KEY.format(model=model)) or 0),
            "last_changes": [e.model_dump(mode="json", by_alias=True) for e in history(client, model, LAST_ENTRIES)],
            "last_refusals": [r.model_dump(mode="json") for r in refusals(client, model, LAST_ENTRIES)],
        })
    return rows


def _ago(at_unix_s: float, now_s: float) -> str:
    seconds = max(0.0, now_s - at_unix_s)
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    return f"{seconds / 60:.0f} min ago" if seconds < 7200 else f"{seconds / 3600:.1f} h ago"


def _split(doc: dict[str, Any]) -> str:
    stable = doc.get("stable") or "(configured)"
    return f"{stable} + canary {doc['canary']} {doc['canary_weight']}%" if doc.get("canary") else stable


def format_model_states(rows: list[dict[str, Any]], now_s: float | None = None) -> list[str]:
    """The MODEL VERSIONS section of the human ``fleet status``."""
    now = time.time() if now_s is None else now_s
    lines = ["MODEL VERSIONS"]
    for row in rows:
        queue = f", canary queue {row['canary_queue']} depth {row['canary_queue_depth']}" if row["canary"] else ""
        autos = f", auto-rollbacks {row['auto_rollbacks']}" if row["auto_rollbacks"] else ""
        lines.append(f"{row['model']}: {_split(row)} (generation {row['generation']}{queue}{autos})")
        for e in row["last_changes"]:
            why = f": {e['reason']}" if e.get("reason") else ""
            lines.append(f"  {_ago(e['at_unix_s'], now)}  {e['action']} by {e['by']}  {_split(e['from'])} -> "
                         f"{_split(e['to'])}{why}")
        for r in row["last_refusals"]:
            lines.append(f"  REFUSED {_ago(r['at_unix_s'], now)}  {r['worker']} refused {r['version']}: "
                         f"{r['error_type']}: {r['error']}")
    return lines
