"""A model's desired state in Redis: the pinned (stable) version, the canary and its traffic share.

Keys (``model`` is the configured model key, :meth:`FleetSettings.model_key`)::

    fleet:model-state:{model}        JSON ModelState; missing = no pin (workers serve their config)
    fleet:model-history:{model}      list, RPUSH of JSON HistoryEntry (oldest first, last 1000 kept:
                                     HISTORY_KEEP)
    fleet:model-undo:{model}         JSON UndoStack: the stable versions rollbacks return to, most recent
                                     last (last 1000 kept: UNDO_KEEP), however long ago their pins were
    fleet:model-refusals:{model}     list of JSON Refusal (last 50, expires 7 days after the last one)
    fleet:model-outcomes:{model}     stream of finished requests while a canary is set (MAXLEN ~ 20000):
                                     version, role (stable|canary: the engine's), ok (1|0), latency_ms,
                                     at (unix s), asked (stable|canary: the queue's role)
    fleet:model-auto-rollbacks:{model}  counter of automatic rollbacks
    fleet:model-recent-prompts:{model}  list of JSON token-id lists: 1 in 20 requests' prompts, sampled
                                     by producers while a canary is set (last 200, expires after a day)
    fleet:model-changes              pub/sub channel: the model name, published after every change

Every change (:func:`pin`, :func:`set_canary`, :func:`promote`, :func:`rollback`) is one
WATCH/MULTI transaction: the state (generation + 1), its history entry and the rollback stack are
written together or not at all, then the model's name is published on ``fleet:model-changes``.

Traffic: :func:`route` sends a request to the canary when the sticky fraction of its routing key
(the request ID unless the caller gives a ``routing_key``) is below ``canary_weight / 100``.
Stable traffic is queued on ``settings.queue_for(m)``, canary traffic on
``settings.canary_queue_for(m)`` (``fleet.<m>.canary``). A worker computes a canary-queue message
with the canary version when it has it loaded, else with the stable one; every result names the
version that computed it.

Targeting one version explicitly (``fleet models compare``'s shadow sample) uses the role queues:
the same request body is sent once to the stable queue and once to the canary queue, and only pairs
whose results name the stable and the canary version are compared.

Where each part lives (this module re-exports them all): the keys and records in
:mod:`protocol.model_records`, routing in :mod:`protocol.model_routing`, the changes in
:mod:`protocol.model_changes`, refusals, sampled prompts and outcomes in :mod:`protocol.model_reports`,
the automatic rollback in :mod:`protocol.canary_guard`, the rollback stack in :mod:`protocol.model_undo`.
"""

from __future__ import annotations

from protocol.canary_guard import GUARD_LOCK_MS, guard_canary
from protocol.canary_verdict import Outcome, Verdict, canary_verdict
from protocol.model_changes import HISTORY_KEEP, MAX_WEIGHT, MIN_WEIGHT, pin, promote, rollback, set_canary
from protocol.model_records import (
    AUTO_ROLLBACKS_KEY,
    CHANGES_CHANNEL,
    GUARD_LOCK_KEY,
    GUARD_TURN_KEY,
    HISTORY_KEY,
    OUTCOMES_KEY,
    RECENT_PROMPTS_KEY,
    REFUSALS_KEY,
    STATE_KEY,
    Action,
    HistoryEntry,
    ModelState,
    Published,
    Refusal,
    Role,
    Split,
    VersionCheck,
    history,
    read_state,
)
from protocol.model_reports import (
    AT_PRECISION_S,
    OUTCOMES_MAXLEN,
    RECENT_PROMPTS_KEEP,
    RECENT_PROMPTS_TTL_S,
    RECENT_SAMPLE_FRACTION,
    REFUSALS_KEEP,
    REFUSALS_TTL_S,
    outcome_fields,
    read_outcomes,
    recent_prompts,
    record_outcomes,
    record_recent_prompt,
    record_refusal,
    refusals,
    samples_prompt,
)
from protocol.model_routing import route, routing_fraction
from protocol.model_undo import UNDO_KEEP, UNDO_KEY, UndoStack

__all__ = [
    "AT_PRECISION_S",
    "AUTO_ROLLBACKS_KEY",
    "CHANGES_CHANNEL",
    "GUARD_LOCK_KEY",
    "GUARD_LOCK_MS",
    "GUARD_TURN_KEY",
    "HISTORY_KEEP",
    "HISTORY_KEY",
    "MAX_WEIGHT",
    "MIN_WEIGHT",
    "OUTCOMES_KEY",
    "OUTCOMES_MAXLEN",
    "RECENT_PROMPTS_KEEP",
    "RECENT_PROMPTS_KEY",
    "RECENT_PROMPTS_TTL_S",
    "RECENT_SAMPLE_FRACTION",
    "REFUSALS_KEEP",
    "REFUSALS_KEY",
    "REFUSALS_TTL_S",
    "STATE_KEY",
    "UNDO_KEEP",
    "UNDO_KEY",
    "Action",
    "HistoryEntry",
    "ModelState",
    "Outcome",
    "Published",
    "Refusal",
    "Role",
    "Split",
    "UndoStack",
    "Verdict",
    "VersionCheck",
    "canary_verdict",
    "guard_canary",
    "history",
    "outcome_fields",
    "pin",
    "promote",
    "read_outcomes",
    "read_state",
    "recent_prompts",
    "record_outcomes",
    "record_recent_prompt",
    "record_refusal",
    "refusals",
    "rollback",
    "route",
    "routing_fraction",
    "samples_prompt",
    "set_canary",
]
