"""Changes to a model's desired state (:func:`pin`, :func:`set_canary`, :func:`promote`, :func:`rollback`),
each one WATCH/MULTI transaction that writes the state (generation + 1) and its history entry together,
then publishes the model's name on ``fleet:model-changes``. The keys: :mod:`protocol.model_records`.
The same transaction rewrites the rollback stack (:mod:`protocol.model_undo`), kept apart from the history,
which keeps the last :data:`HISTORY_KEEP` entries only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from protocol.errors import FleetError, StateChangeRefused
from protocol.model_records import (
    CHANGES_CHANNEL,
    HISTORY_KEY,
    STATE_KEY,
    Action,
    HistoryEntry,
    ModelState,
    Published,
    Split,
    VersionCheck,
    history,
)
from protocol.model_undo import UNDO_KEY, UndoStack, next_undo, read_undo, undo_of_history

__all__ = ["HISTORY_KEEP", "MAX_WEIGHT", "MIN_WEIGHT", "pin", "promote", "rollback", "set_canary"]

HISTORY_KEEP = 1000
"""History entries kept per model (the oldest are trimmed)."""
MIN_WEIGHT, MAX_WEIGHT = 1, 99
"""A canary's share of the traffic (percent)."""


def _change(
    r: redis.Redis[bytes],
    model: str,
    by: str,
    action: Action,
    decide: Callable[[ModelState, UndoStack], Split],
    *,
    reason: str | None = None,
    figures: dict[str, Any] | None = None,
    expect_generation: int | None = None,
) -> HistoryEntry:
    """Apply ``decide(current, rollback stack) -> new split`` as one transaction (retried when another change
    raced); the rollback stack follows the change (:func:`protocol.model_undo.next_undo`)."""
    state_key, history_key = STATE_KEY.format(model=model), HISTORY_KEY.format(model=model)
    undo_key = UNDO_KEY.format(model=model)
    with r.pipeline() as pipe:
        while True:
            try:
                pipe.watch(state_key, undo_key)
                raw: bytes | None = pipe.get(state_key)  # type: ignore[assignment]  # immediate mode after WATCH
                current = ModelState(model=model) if raw is None else ModelState.model_validate_json(raw)
                stack = _stack(r, pipe, model)
                if expect_generation is not None and current.generation != expect_generation:
                    raise StateChangeRefused(
                        f"{model}: the state changed meanwhile (generation {current.generation}, "
                        f"expected {expect_generation})",
                        "generation",
                        expect_generation,
                    )
                new = decide(current, stack)
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
                pipe.set(undo_key, next_undo(stack, action, current.split(), new).model_dump_json())
                pipe.execute()
                break
            except redis.WatchError:
                continue
    r.publish(CHANGES_CHANNEL, model)
    return entry


def _stack(r: redis.Redis[bytes], pipe: Any, model: str) -> UndoStack:
    """The model's rollback stack; one never stored (a model changed before it existed, or never) is rebuilt
    from the history (read on ``r``: it changes only with the watched state)."""
    stored = read_undo(pipe, model)
    if stored is not None:
        return stored
    entries = history(r, model)
    return undo_of_history(entries, may_be_trimmed=len(entries) >= HISTORY_KEEP)


def _check_published(
    store: Published | None, model: str, version: str, check: VersionCheck | None = None
) -> str | None:
    """The sha256 of ``version``'s manifest in ``store`` (what the change records: workers then load those
    bytes or refuse); None without a store (nothing to check against)."""
    if not version or not version.strip():
        raise StateChangeRefused(f"{model}: version must be a non-empty string", "version", "non-empty")
    digest = None
    if store is not None:
        digest = store.manifest_sha256(model, version)  # raises VersionNotFound naming the model and the version
    if check is not None:
        check(model, version)
    return digest


def pin(
    r: redis.Redis[bytes], model: str, version: str, by: str, *, store: Published | None = None,
    check: VersionCheck | None = None,
) -> HistoryEntry:
    """Make ``version`` the stable one; an ongoing canary stays (unless it is that same version).

    With ``store``, the state records the sha256 of the version's manifest as published now
    (``stable_manifest_sha256``): workers serve those bytes or refuse the version. Pinning the version that is
    already pinned records the manifest anew (how new bytes under an old name are accepted).

    Raises:
        VersionNotFound: ``store`` is given and the version is not published there.
        IncompatibleVersion: ``check`` is given and refuses the version (nothing changes).
    """
    digest = _check_published(store, model, version, check)

    def decide(cur: ModelState, _: UndoStack) -> Split:
        if cur.canary == version:
            return Split(stable=version, stable_manifest_sha256=digest)
        return Split(stable=version, stable_manifest_sha256=digest, canary=cur.canary,
                     canary_weight=cur.canary_weight, canary_manifest_sha256=cur.canary_manifest_sha256)

    return _change(r, model, by, "pin", decide)


def set_canary(
    r: redis.Redis[bytes], model: str, version: str, weight: int, by: str, *, store: Published | None = None,
    check: VersionCheck | None = None,
) -> HistoryEntry:
    """Send ``weight`` percent (1..99) of the model's traffic to ``version``; with ``store``, the state records
    the sha256 of its manifest (``canary_manifest_sha256``, as :func:`pin` does).

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
    digest = _check_published(store, model, version, check)

    def decide(cur: ModelState, _: UndoStack) -> Split:
        if cur.stable == version:
            raise StateChangeRefused(f"{model}: {version} is already the stable version", "version", cur.stable)
        return Split(stable=cur.stable, stable_manifest_sha256=cur.stable_manifest_sha256, canary=version,
                     canary_weight=weight, canary_manifest_sha256=digest)

    return _change(r, model, by, "canary", decide)


def promote(r: redis.Redis[bytes], model: str, by: str, *, check: VersionCheck | None = None) -> HistoryEntry:
    """Make the canary the stable version (all traffic).

    Raises:
        StateChangeRefused: the model has no canary.
        IncompatibleVersion: ``check`` is given and refuses the canary (one set before the check, or by a
            caller without it): nothing changes; roll it back.
    """

    def decide(cur: ModelState, _: UndoStack) -> Split:
        if cur.canary is None:
            raise StateChangeRefused(f"{model} has no canary to promote", "canary", None)
        if check is not None:
            check(model, cur.canary)
        return Split(stable=cur.canary, stable_manifest_sha256=cur.canary_manifest_sha256)

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
    store: Published | None = None,
) -> HistoryEntry:
    """Drop the canary (all traffic back to stable); with no canary, undo the last pin or promote: the
    stable version returns to the one it replaced (None = the configured one). Repeated rollbacks walk
    further back, one pin or promote at a time, through every one made (the rollback stack,
    :mod:`protocol.model_undo`, not the history: it keeps the last :data:`HISTORY_KEEP` changes only), up to
    the :data:`~protocol.model_undo.UNDO_KEEP` most recent.

    ``store``: when given, undoing a pin or promote checks that the version it returns to is still
    published there (a version deleted from the store would be refused by every worker that has not
    cached it: the rollback would take effect nowhere). Only a definite "not published" refuses; a store
    that cannot be reached does not hold a rollback up. Dropping a canary never asks the store.

    Manifest digests: the stable version returned to keeps the digest it was pinned with (the rollback stack
    records it); one pinned before digests were recorded gets the digest its manifest has now in ``store``
    (none without a store: workers then check nothing). Dropping a canary keeps the stable one's digest.

    Raises:
        StateChangeRefused: neither a canary nor a pin or promote left to undo (past the stack's
            :data:`~protocol.model_undo.UNDO_KEEP` versions: field ``rollback``, that limit); the version it would
            return to is no longer published in ``store``; or ``expect_generation`` is given and the
            state changed since.
    """

    def decide(cur: ModelState, stack: UndoStack) -> Split:
        if cur.canary is not None:
            return Split(stable=cur.stable, stable_manifest_sha256=cur.stable_manifest_sha256)
        if auto:
            raise StateChangeRefused(f"{model} has no canary to roll back", "canary", None)
        if not stack.versions:
            raise stack.refusal(model, HISTORY_KEEP)
        back_to, digest = stack.versions[-1], stack.manifest_sha256_at(-1)
        if store is not None and back_to is not None:
            now = _check_still_published(store, model, back_to, cur.stable)
            digest = digest or now  # pinned before digests were recorded: the bytes published now
        return Split(stable=back_to, stable_manifest_sha256=digest)

    action: Action = "auto-rollback" if auto else "rollback"
    return _change(
        r, model, by, action, decide, reason=reason, figures=figures, expect_generation=expect_generation
    )


STORE_CHECK_WAIT_S = 5.0
"""How long a rollback waits for the store to say whether the version it returns to is still published (s): a
store that accepts connections and never answers held a rollback up for the S3 client's whole retry budget (60 s
reads, 4 tries: 4 minutes), and a rollback is the emergency stop."""

log = logging.getLogger("fleet.models")


def _check_still_published(store: Published, model: str, version: str, current: str | None) -> str | None:
    """Refuse to return the stable version to ``version`` when ``store`` says it is not published (any other
    store error, or no answer within :data:`STORE_CHECK_WAIT_S`, lets the rollback through: an unreachable or
    hung store must not hold up an emergency); the sha256 of its manifest now, None when the store could not
    say."""
    try:
        return _within(lambda: store.manifest_sha256(model, version), STORE_CHECK_WAIT_S)
    except TimeoutError:
        log.warning("%s: the model store did not answer within %g s whether %s is still published: rolled back "
                    "without that check", model, STORE_CHECK_WAIT_S, version)  # fmt: skip
        return None
    except FleetError as exc:
        if exc.code != "version_not_found":
            return None
        raise StateChangeRefused(
            f"{model}: cannot roll back from {current or 'the configured version'} to {version}: {version} is no "
            f"longer published in the model store ({exc}); pin a published version instead "
            f"(`fleet models pin {model} VERSION`)",
            "version",
            "a published version",
        ) from exc


def _within(call: Callable[[], str], wait_s: float) -> str:
    """``call()``'s value, asked on a daemon thread and waited for at most ``wait_s`` seconds (a thread left behind
    does not hold the process's exit).

    Raises:
        TimeoutError: no answer within ``wait_s``.
        Exception: what ``call`` raised.
    """
    box: dict[str, Any] = {}
    done = threading.Event()

    def ask() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # handed to the caller's thread
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=ask, name="fleet-store-check", daemon=True).start()
    if not done.wait(wait_s):
        raise TimeoutError(f"no answer within {wait_s} s")
    if "error" in box:
        raise box["error"]
    return str(box["value"])
