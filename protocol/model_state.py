"""A model's desired state in Redis: the pinned (stable) version, the canary and its traffic share.

Keys (``model`` is the configured model key, :meth:`FleetSettings.model_key`)::

    fleet:model-state:{model}        JSON ModelState; missing = no pin (workers serve their config)
    fleet:model-history:{model}      list, RPUSH of JSON HistoryEntry (oldest first, last 1000 kept)
    fleet:model-refusals:{model}     list of JSON Refusal (last 50, expires 7 days after the last one)
    fleet:model-outcomes:{model}     stream of finished requests while a canary is set (MAXLEN ~ 20000):
                                     version, role (stable|canary: the engine's), ok (1|0), latency_ms,
                                     at (unix s), asked (stable|canary: the queue's role)
    fleet:model-auto-rollbacks:{model}  counter of automatic rollbacks
    fleet:model-recent-prompts:{model}  list of JSON token-id lists: 1 in 20 requests' prompts, sampled
                                     by producers while a canary is set (last 200, expires after a day)
    fleet:model-changes              pub/sub channel: the model name, published after every change

Every change (:func:`pin`, :func:`set_canary`, :func:`promote`, :func:`rollback`) is one
WATCH/MULTI transaction: the state (generation + 1) and its history entry are written together or
not at all, then the model's name is published on ``fleet:model-changes``.

Traffic: :func:`route` sends a request to the canary when the sticky fraction of its routing key
(the request ID unless the caller gives a ``routing_key``) is below ``canary_weight / 100``.
Stable traffic is queued on ``settings.queue_for(m)``, canary traffic on
``settings.canary_queue_for(m)`` (``fleet.<m>.canary``). A worker computes a canary-queue message
with the canary version when it has it loaded, else with the stable one; every result names the
version that computed it.

Targeting one version explicitly (``fleet models compare``'s shadow sample) uses the role queues:
the same request body is sent once to the stable queue and once to the canary queue, and only pairs
whose results name the stable and the canary version are compared.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from hashlib import sha256
from typing import Any, Literal, Protocol

import redis
from pydantic import BaseModel, ConfigDict, Field

from protocol.canary_verdict import Outcome, Verdict, canary_verdict, unserved_canary_verdict
from protocol.errors import StateChangeRefused
from protocol.settings import FleetSettings

__all__ = [
    "AUTO_ROLLBACKS_KEY",
    "CHANGES_CHANNEL",
    "HISTORY_KEY",
    "OUTCOMES_KEY",
    "RECENT_PROMPTS_KEY",
    "REFUSALS_KEY",
    "STATE_KEY",
    "HistoryEntry",
    "ModelState",
    "Outcome",
    "Published",
    "Refusal",
    "Role",
    "Split",
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

STATE_KEY = "fleet:model-state:{model}"
HISTORY_KEY = "fleet:model-history:{model}"
REFUSALS_KEY = "fleet:model-refusals:{model}"
OUTCOMES_KEY = "fleet:model-outcomes:{model}"
AUTO_ROLLBACKS_KEY = "fleet:model-auto-rollbacks:{model}"
RECENT_PROMPTS_KEY = "fleet:model-recent-prompts:{model}"
GUARD_LOCK_KEY = "fleet:model-guard-lock:{model}"
GUARD_TURN_KEY = "fleet:model-guard-turn:{model}"
"""Whose turn it is to judge the canary (see :func:`guard_canary`'s ``one_caller_per_s``)."""
CHANGES_CHANNEL = "fleet:model-changes"

HISTORY_KEEP = 1000
REFUSALS_KEEP = 50
REFUSALS_TTL_S = 7 * 86_400
OUTCOMES_MAXLEN = 20_000
GUARD_LOCK_MS = 5_000
MIN_WEIGHT, MAX_WEIGHT = 1, 99
RECENT_PROMPTS_KEEP = 200
AT_PRECISION_S = 0.001
"""Outcomes carry ``at`` rounded to the millisecond: one finished just after a change may read as just before."""
RECENT_PROMPTS_TTL_S = 86_400
RECENT_SAMPLE_FRACTION = 0.05

Role = Literal["stable", "canary"]
Action = Literal["pin", "canary", "promote", "rollback", "auto-rollback"]


class Split(BaseModel):
    """The versions in force: stable (None = the configured one), canary and its share (percent)."""

    model_config = ConfigDict(frozen=True)

    stable: str | None = None
    canary: str | None = None
    canary_weight: int = Field(default=0, ge=0, le=100)


class ModelState(Split):
    """The JSON at ``fleet:model-state:{model}``; ``generation`` grows by one at every change."""

    model: str
    generation: int = Field(default=0, ge=0)
    changed_by: str = ""
    changed_at_unix_s: float = 0.0

    def split(self) -> Split:
        """Only the versions and the weight (what a history entry records as from/to)."""
        return Split(stable=self.stable, canary=self.canary, canary_weight=self.canary_weight)


class HistoryEntry(BaseModel):
    """One change, as RPUSHed to ``fleet:model-history:{model}``."""

    model_config = ConfigDict(frozen=True, populate_by_name=True)

    at_unix_s: float
    by: str
    action: Action
    from_: Split = Field(alias="from")
    to: Split
    reason: str | None = None
    figures: dict[str, Any] | None = None
    generation: int = 0

    def to_json(self) -> str:
        """The stored JSON (``from`` spelled as such)."""
        return self.model_dump_json(by_alias=True)


class Refusal(BaseModel):
    """A worker refused to load a version (checksum mismatch, not published, load error)."""

    model_config = ConfigDict(frozen=True)

    worker: str
    version: str
    error: str
    error_type: str
    at_unix_s: float


class Published(Protocol):
    """What pin/canary check a version against: the store's ``manifest`` (raises VersionNotFound)."""

    def manifest(self, model: str, version: str) -> object: ...


VersionCheck = Callable[[str, str], None]
"""``check(model, version)`` raises when ``version`` may not serve ``model``: the CLI passes
:func:`store.cards.version_check` (IncompatibleVersion: a card of another kind, vocab_size, …)."""


# ---- routing (pure) ----


def routing_fraction(key: str) -> float:
    """A fixed fraction in [0, 1) for ``key``: the first 8 bytes of its sha256 over 2**64.

    Never raises: a key that is not valid UTF-8 text (a lone surrogate, which JSON can carry) is hashed as
    its ``surrogatepass`` bytes, so it still routes the same way every time."""
    return int.from_bytes(sha256(key.encode("utf-8", "surrogatepass")).digest()[:8], "big") / 2**64


def route(state: ModelState | None, key: str) -> Role:
    """``canary`` when a canary is set and ``key``'s fraction is below its weight, else ``stable``."""
    if state is None or state.canary is None or state.canary_weight <= 0:
        return "stable"
    return "canary" if routing_fraction(key) < state.canary_weight / 100 else "stable"


# ---- reading ----


def read_state(r: redis.Redis[bytes], model: str) -> ModelState | None:
    """The model's state, or None when it has none (no pin: workers serve their config)."""
    raw = r.get(STATE_KEY.format(model=model))
    return None if raw is None else ModelState.model_validate_json(raw)


def history(r: redis.Redis[bytes], model: str, last: int | None = None) -> list[HistoryEntry]:
    """The model's changes, oldest first (only the ``last`` N when given)."""
    start = -last if last else 0
    return [HistoryEntry.model_validate_json(raw) for raw in r.lrange(HISTORY_KEY.format(model=model), start, -1)]


# ---- changes ----


def _change(
    r: redis.Redis[bytes],
    model: str,
    by: str,
    action: Action,
    decide: Callable[[ModelState], Split],
    *,
    reason: str | None = None,
    figures: dict[str, Any] | None = None,
    expect_generation: int | None = None,
) -> HistoryEntry:
    """Apply ``decide(current) -> new split`` as one transaction (retried when another change raced)."""
    state_key, history_key = STATE_KEY.format(model=model), HISTORY_KEY.format(model=model)
    with r.pipeline() as pipe:
        while True:
            try:
                pipe.watch(state_key)
                raw: bytes | None = pipe.get(state_key)  # type: ignore[assignment]  # immediate mode after WATCH
                current = ModelState(model=model) if raw is None else ModelState.model_validate_json(raw)
                if expect_generation is not None and current.generation != expect_generation:
                    raise StateChangeRefused(
                        f"{model}: the state changed meanwhile (generation {current.generation}, "
                        f"expected {expect_generation})",
                        "generation",
                        expect_generation,
                    )
                new = decide(current)
                now = time.time()
                state = ModelState(
                    model=model, **new.model_dump(), generation=current.generation + 1, changed_by=by,
                    changed_at_unix_s=now,
                )
                entry = HistoryEntry.model_validate({
                    "at_unix_s": now, "by": by, "action": action, "from": current.split(), "to": new,
                    "reason": reason, "figures": figures, "generation": state.generation,
                })
                pipe.multi()
                pipe.set(state_key, state.model_dump_json())
                pipe.rpush(history_key, entry.to_json())
                pipe.ltrim(history_key, -HISTORY_KEEP, -1)
                pipe.execute()
                break
            except redis.WatchError:
                continue
    r.publish(CHANGES_CHANNEL, model)
    return entry


def _check_published(store: Published | None, model: str, version: str, check: VersionCheck | None = None) -> None:
    if not version or not version.strip():
        raise StateChangeRefused(f"{model}: version must be a non-empty string", "version", "non-empty")
    if store is not None:
        store.manifest(model, version)  # raises VersionNotFound naming the model and the version
    if check is not None:
        check(model, version)


def pin(
    r: redis.Redis[bytes], model: str, version: str, by: str, *, store: Published | None = None,
    check: VersionCheck | None = None,
) -> HistoryEntry:
    """Make ``version`` the stable one; an ongoing canary stays (unless it is that same version).

    Raises:
        VersionNotFound: ``store`` is given and the version is not published there.
        IncompatibleVersion: ``check`` is given and refuses the version (nothing changes).
    """
    _check_published(store, model, version, check)

    def decide(cur: ModelState) -> Split:
        if cur.canary == version:
            return Split(stable=version)
        return Split(stable=version, canary=cur.canary, canary_weight=cur.canary_weight)

    return _change(r, model, by, "pin", decide)


def set_canary(
    r: redis.Redis[bytes], model: str, version: str, weight: int, by: str, *, store: Published | None = None,
    check: VersionCheck | None = None,
) -> HistoryEntry:
    """Send ``weight`` percent (1..99) of the model's traffic to ``version``.

    Raises:
        StateChangeRefused: ``weight`` out of 1..99, or ``version`` is already the stable one.
        VersionNotFound: ``store`` is given and the version is not published there.
        IncompatibleVersion: ``check`` is given and refuses the version (nothing changes).
    """
    if not MIN_WEIGHT <= weight <= MAX_WEIGHT:
        raise StateChangeRefused(
            f"weight must be between {MIN_WEIGHT} and {MAX_WEIGHT} (percent of traffic), got {weight}",
            "weight",
            f"{MIN_WEIGHT}..{MAX_WEIGHT}",
        )
    _check_published(store, model, version, check)

    def decide(cur: ModelState) -> Split:
        if cur.stable == version:
            raise StateChangeRefused(f"{model}: {version} is already the stable version", "version", cur.stable)
        return Split(stable=cur.stable, canary=version, canary_weight=weight)

    return _change(r, model, by, "canary", decide)


def promote(r: redis.Redis[bytes], model: str, by: str, *, check: VersionCheck | None = None) -> HistoryEntry:
    """Make the canary the stable version (all traffic).

    Raises:
        StateChangeRefused: the model has no canary.
        IncompatibleVersion: ``check`` is given and refuses the canary (one set before the check, or by a
            caller without it): nothing changes; roll it back.
    """

    def decide(cur: ModelState) -> Split:
        if cur.canary is None:
            raise StateChangeRefused(f"{model} has no canary to promote", "canary", None)
        if check is not None:
            check(model, cur.canary)
        return Split(stable=cur.canary)

    return _change(r, model, by, "promote", decide)


def rollback(
    r: redis.Redis[bytes],
    model: str,
    by: str,
    reason: str | None = None,
    figures: dict[str, Any] | None = None,
    auto: bool = False,
    *,
    expect_generation: int | None = None,
) -> HistoryEntry:
    """Drop the canary (all traffic back to stable); with no canary, undo the last pin or promote: the
    stable version returns to the one it replaced (None = the configured one). Repeated rollbacks walk
    further back, one pin or promote at a time.

    Raises:
        StateChangeRefused: neither a canary nor a pin or promote left to undo; or
            ``expect_generation`` is given and the state changed since.
    """

    def decide(cur: ModelState) -> Split:
        if cur.canary is not None:
            return Split(stable=cur.stable)
        if auto:
            raise StateChangeRefused(f"{model} has no canary to roll back", "canary", None)
        earlier = _undo_stack(history(r, model))
        if not earlier:
            raise StateChangeRefused(
                f"{model} has no canary and no pin or promote to undo", "canary", None
            )
        return Split(stable=earlier[-1])

    action: Action = "auto-rollback" if auto else "rollback"
    return _change(
        r, model, by, action, decide, reason=reason, figures=figures, expect_generation=expect_generation
    )


def _undo_stack(entries: list[HistoryEntry]) -> list[str | None]:
    """The stable versions a rollback would return to, most recent last: every pin or promote that
    changed the stable pushes the one it replaced; every rollback that changed it pops one."""
    stack: list[str | None] = []
    for entry in entries:
        if entry.from_.stable == entry.to.stable:
            continue
        if entry.action in ("pin", "promote"):
            stack.append(entry.from_.stable)
        elif entry.action == "rollback" and stack:
            stack.pop()
    return stack


# ---- refusals (written by workers) ----


def record_refusal(r: redis.Redis[bytes], model: str, worker: str, version: str, exc: BaseException) -> Refusal:
    """Record that ``worker`` refused ``version`` (kept: the last 50, for 7 days)."""
    refusal = Refusal(worker=worker, version=version, error=str(exc), error_type=type(exc).__name__,
                      at_unix_s=time.time())
    key = REFUSALS_KEY.format(model=model)
    pipe = r.pipeline(transaction=False)
    pipe.rpush(key, refusal.model_dump_json())
    pipe.ltrim(key, -REFUSALS_KEEP, -1)
    pipe.expire(key, REFUSALS_TTL_S)
    pipe.execute()
    return refusal


def refusals(r: redis.Redis[bytes], model: str, last: int | None = None) -> list[Refusal]:
    """The model's recorded refusals, oldest first (only the ``last`` N when given)."""
    start = -last if last else 0
    return [Refusal.model_validate_json(raw) for raw in r.lrange(REFUSALS_KEY.format(model=model), start, -1)]


# ---- recent prompts (sampled by producers while a canary is set: compare's shadow sample) ----


def samples_prompt(request_id: str) -> bool:
    """Whether the prompt of ``request_id`` is one of the sampled 1 in 20 (a hash apart from routing's)."""
    return routing_fraction("recent-prompt:" + request_id) < RECENT_SAMPLE_FRACTION


def record_recent_prompt(r: redis.Redis[bytes], model: str, input_ids: Iterable[int]) -> None:
    """Keep ``input_ids`` among the model's recent prompts (newest first, the last 200, for a day)."""
    key = RECENT_PROMPTS_KEY.format(model=model)
    pipe = r.pipeline(transaction=False)
    pipe.lpush(key, json.dumps(list(input_ids)))
    pipe.ltrim(key, 0, RECENT_PROMPTS_KEEP - 1)
    pipe.expire(key, RECENT_PROMPTS_TTL_S)
    pipe.execute()


def recent_prompts(r: redis.Redis[bytes], model: str, n: int) -> list[list[int]]:
    """Up to ``n`` of the model's most recent sampled prompts (token ids), newest first."""
    return [json.loads(raw) for raw in r.lrange(RECENT_PROMPTS_KEY.format(model=model), 0, n - 1)] if n > 0 else []


# ---- outcomes (written by workers while a canary is set) ----


def outcome_fields(version: str, role: Role, ok: bool, latency_ms: float, at_unix_s: float,
                   asked: Role | None = None) -> dict[str, str]:
    """The stream entry of one finished request (``asked``: its queue's role, None = ``role``)."""
    return {"version": version, "role": role, "ok": "1" if ok else "0", "latency_ms": f"{latency_ms:.3f}",
            "at": f"{at_unix_s:.3f}", "asked": asked or role}


def record_outcomes(pipe: Any, model: str, samples: Iterable[Outcome]) -> None:
    """Queue one XADD per sample on ``pipe`` (a redis pipeline: the caller executes it once per batch)."""
    key = OUTCOMES_KEY.format(model=model)
    for s in samples:
        fields = outcome_fields(s.version, s.role, s.ok, s.latency_ms, s.at_unix_s, s.asked)
        pipe.xadd(key, fields, maxlen=OUTCOMES_MAXLEN, approximate=True)


def read_outcomes(r: redis.Redis[bytes], model: str, window_s: float, *, since_unix_s: float = 0.0) -> list[Outcome]:
    """Outcomes that finished in the last ``window_s`` seconds (and not before ``since_unix_s``)."""
    floor = max(time.time() - window_s, since_unix_s)
    entries = r.xrange(OUTCOMES_KEY.format(model=model), min=str(max(0, int(floor * 1000) - 1_000)), max="+")
    out = []
    for _id, fields in entries:
        f = {k.decode() if isinstance(k, bytes) else k: v.decode() if isinstance(v, bytes) else v
             for k, v in fields.items()}
        at = float(f["at"])
        if at >= floor - AT_PRECISION_S:
            role: Role = "canary" if f["role"] == "canary" else "stable"
            asked: Role = "canary" if f.get("asked", f["role"]) == "canary" else "stable"
            out.append(Outcome(f["version"], role, f["ok"] == "1", float(f["latency_ms"]), at, asked))
    return out


def guard_canary(
    r: redis.Redis[bytes], settings: FleetSettings, model: str, *, one_caller_per_s: float | None = None
) -> Verdict | None:
    """Judge the model's canary over its window; roll it back (``by="auto-rollback"``) when it broke
    its bounds. None when the model has no canary. Concurrent callers roll back at most once (a short
    SET NX lock, and the rollback only applies to the generation that was judged).

    ``one_caller_per_s`` (seconds; the workers pass ``canary.check_interval_s``): at most one caller
    fleet-wide judges per that period (a SET NX PX turn), so N workers read the outcome window (up to
    the stream's 20,000 entries) once per period instead of N times. Returns None when another caller
    has the turn.
    """
    state = read_state(r, model)
    if state is None or state.canary is None:
        return None
    if one_caller_per_s is not None and not r.set(
        GUARD_TURN_KEY.format(model=model), "1", nx=True, px=max(1, int(one_caller_per_s * 1000))
    ):
        return None
    bounds = settings.model(model).canary
    samples = read_outcomes(r, model, bounds.window_s, since_unix_s=state.changed_at_unix_s)
    verdict = canary_verdict(samples, bounds, canary=state.canary, stable=state.stable)
    refused = [(x.worker, f"{x.error_type}: {x.error}") for x in refusals(r, model)
               if x.version == state.canary and x.at_unix_s >= state.changed_at_unix_s]
    verdict = unserved_canary_verdict(verdict, samples, state.canary, refused, bounds.min_requests)
    if not verdict.rollback:
        return verdict
    if not r.set(GUARD_LOCK_KEY.format(model=model), "1", nx=True, px=GUARD_LOCK_MS):
        return verdict
    try:
        rollback(r, model, "auto-rollback", reason=verdict.reason, figures=verdict.figures(), auto=True,
                 expect_generation=state.generation)
    except StateChangeRefused:
        return verdict  # someone else changed the state first: nothing to roll back here
    r.incr(AUTO_ROLLBACKS_KEY.format(model=model))
    return verdict

