"""What ``fleet models compare``'s shadow sample says and how the command ends, from plain values (pure).

:func:`shadow_not_served` decides, before anything is queued, whether the live workers can answer a shadow
sample at all (a stable and a canary version each served); :func:`shadow_problem` is the one line said on
stderr when the sample could not be answered in full; :func:`shadow_exit_code` is the command's exit code.
:mod:`producer.shadow` does the I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["SHADOW_TIMEOUT_S", "shadow_exit_code", "shadow_not_served", "shadow_problem"]

SHADOW_TIMEOUT_S = 120.0
"""How long the shadow sample's results are waited for by default (s; ``--shadow-timeout-s``)."""


def _start_one(model: str) -> str:
    """How to get a worker that serves ``model``: the words of :func:`producer.presence.no_worker_message`."""
    return f"start one: `fleet worker --model {model}`; `fleet status` lists the workers"


def shadow_not_served(
    model: str,
    stable: str | None,
    canary: str,
    served: Mapping[str, Sequence[str]],
    canary_served: Mapping[str, Sequence[str]],
    queues: tuple[str, str],
) -> str | None:
    """Why no shadow pair of ``model`` could be compared now (one sentence: what is missing, how to start it),
    else None.

    ``served`` / ``canary_served``: stable / canary version -> hostnames of the live workers serving it
    (:func:`producer.model_status.served_by`, :func:`~producer.model_status.canary_served_by`); ``stable``: the
    desired stable version (None = whatever the workers serve: a model file); ``queues``: the model's stable
    and canary queues. A pair counts only when the stable and the canary version computed it, so each needs a
    live worker: without one, the sample would wait in its queue for nobody.
    """
    if not served:
        return (f"no live worker serves model {model!r}: the shadow sample would wait in {queues[0]} and "
                f"{queues[1]} until one starts, so nothing was sent ({_start_one(model)})")
    missing = []
    if stable is not None and stable not in served:
        missing.append(f"its stable version {stable} (they serve {', '.join(served)})")
    if canary not in canary_served:
        loaded = f"; they have {', '.join(canary_served)} loaded" if canary_served else ""
        missing.append(f"its canary {canary} (none has it loaded{loaded})")
    if not missing:
        return None
    return (f"no live worker of model {model!r} serves " + " nor ".join(missing) + ": no shadow pair could be "
            f"compared, so nothing was sent ({_start_one(model)} and what they serve; a worker with the model "
            f"store configured loads the pinned and canary versions; `fleet models history {model}` lists the "
            "workers' refusals)")


def shadow_problem(shadow: Mapping[str, Any] | None) -> str | None:
    """The line said on stderr (after ``fleet: ``) when the shadow sample was not answered in full, else None:
    refused before anything was sent (``NOT SERVED: …``), requests unfinished at the deadline (cancelled, so
    that none runs later for nobody), or no pair compared."""
    if shadow is None:
        return None
    if shadow.get("not_served"):
        return f"NOT SERVED: {shadow['not_served']}"
    parts = []
    unfinished = int(shadow.get("unfinished") or 0)
    if unfinished:
        sent = 2 * int(shadow["prompts"])
        parts.append(f"{unfinished} of the {sent} shadow requests had no result within {shadow['timeout_s']:g} s "
                     f"(--shadow-timeout-s): cancelled {shadow['cancelled']} of them, so none runs later for nobody "
                     "(one a worker already holds may still end)")
    if shadow["prompts"] and not shadow["compared"]:
        failed, prompts = int(shadow["failed"]), int(shadow["prompts"])
        others = ("" if failed == prompts else "; the others were not computed by the stable and the canary "
                  "version: `fleet status` says what the workers serve")
        parts.append(f"no shadow pair was compared ({failed} of {prompts} failed or unfinished{others})")
    return "; ".join(parts) or None


def shadow_exit_code(shadow: Mapping[str, Any] | None) -> int:
    """``fleet models compare``'s exit code from its ``shadow`` document: 1 when a shadow sample was asked for and
    it was refused as NOT SERVED (nothing sent), or every pair failed or timed out. Else 0: no sample asked for,
    no canary, not an LM, some pairs compared, or every pair answered but none by both versions (a fleet that
    mixes workers of other versions, which serve some of either queue: said on stderr, counted in the document;
    the command worked, the fleet is what the note is about). Failures are counted and said on stderr."""
    if shadow is None:
        return 0
    if shadow.get("not_served"):
        return 1
    prompts, failed = int(shadow["prompts"]), int(shadow["failed"])
    return 1 if prompts and not shadow["compared"] and failed == prompts else 0
