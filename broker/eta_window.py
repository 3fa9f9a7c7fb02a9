"""How far ahead a message's ETA may be on the Redis broker (pure: the header, the time and the visibility
timeout in, a verdict out).

A Celery message with an ``eta`` (a plain client's ``apply_async(countdown=…)`` or ``eta=…``) is taken
off the queue at once and held, unacked, in the worker's ETA timer until it is due. kombu's Redis
transport restores every unacked message older than its ``visibility_timeout`` (the fleet's
``visibility_timeout_s``) to the queue, whoever holds it: another worker (or the same one) takes it and
holds it too, and when the ETA comes each holder runs it (Celery's documented caveat for Redis). The
fleet promises a request runs once, so the poison guard (:mod:`broker.poison`) refuses, at take, a
message whose ETA is further ahead than :func:`max_eta_ahead_s`.

The margin. The unacked entry is stamped when the message is taken, and the earliest restore is
``visibility_timeout_s`` later, on the clock of whichever worker scans (each scans every
``restore_interval_s``, so a restore can come later, never sooner). Within that window the request must
wait for its ETA *and* then run: wait for a thread, the batch window, inference, the result write that
acks it; and the hosts' clocks may disagree by a little. The visibility timeout is sized to cover a
request's whole time in a worker (``visibility_timeout_s``: "must exceed the longest queue wait +
inference"), so an ETA may use at most half of it (:data:`ETA_MARGIN_FRACTION`), and the other half is
kept for the run after it and for the clocks: at the default 3600 s an ETA up to 30 minutes ahead runs,
with 30 minutes left to finish. A longer ETA needs a longer visibility timeout (which also delays the
redelivery of a dead worker's requests), or the client sends the message closer to its time.

ETAs are read as Celery's ``Request`` reads them (``maybe_iso8601``, then ``maybe_make_aware``: a naive
time is UTC). Wall-clock time, unlike the fleet's windows: an ETA is a wall-clock time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC
from typing import Any

from celery.utils.time import maybe_iso8601, maybe_make_aware
from kombu.utils.json import loads as _kombu_loads

__all__ = ["ETA_FIELD", "ETA_MARGIN_FRACTION", "EtaTooFar", "eta_too_far", "eta_unix_s", "item_eta_too_far",
           "max_eta_ahead_s"]

ETA_MARGIN_FRACTION = 0.5
"""The part of the visibility timeout kept for the run after the ETA (and the hosts' clocks); see the module doc."""
ETA_FIELD = "headers.eta"


def max_eta_ahead_s(visibility_timeout_s: float) -> float:
    """How far ahead of now an ETA may be (s): ``visibility_timeout_s`` less the margin."""
    return visibility_timeout_s * (1.0 - ETA_MARGIN_FRACTION)


def eta_unix_s(value: str) -> float:
    """The ETA header ``value`` as Unix seconds, read as Celery reads it (a naive time is UTC).

    Raises:
        ValueError: ``value`` is not an ISO 8601 time (or one too far out to convert); the header checks
            (:mod:`broker.message_check`) refuse such a message first.
    """
    try:
        parsed = maybe_iso8601(value)
        if parsed is None:
            raise ValueError("an empty string")
        return float(maybe_make_aware(parsed).astimezone(UTC).timestamp())
    except ValueError:
        raise
    except Exception as exc:  # dateutil raises OverflowError and others on odd strings
        raise ValueError(f"{type(exc).__name__}: {exc}") from exc


@dataclass(frozen=True)
class EtaTooFar:
    """An ETA further ahead than a worker may hold a message: what it was, when it was checked, the limit."""

    eta: str
    """The header as sent."""
    eta_unix_s: float
    now_unix_s: float
    """When it was checked."""
    visibility_timeout_s: float

    @property
    def ahead_s(self) -> float:
        """How far ahead of the check the ETA is (s)."""
        return self.eta_unix_s - self.now_unix_s

    @property
    def limit_s(self) -> float:
        """The most an ETA may be ahead (s): :func:`max_eta_ahead_s`."""
        return max_eta_ahead_s(self.visibility_timeout_s)

    @property
    def in_reach_at_unix_s(self) -> float:
        """From when the ETA is within the limit (a worker would take the message from then on)."""
        return self.eta_unix_s - self.limit_s

    def summary(self) -> str:
        """The field, the value, how far ahead, the limit and the visibility timeout, in words."""
        return (
            f"{ETA_FIELD} {self.eta!r}"[:120] + f" is {self.ahead_s:.0f} s ahead, beyond the limit of "
            f"{_seconds(self.limit_s)} s ahead (visibility_timeout_s={_seconds(self.visibility_timeout_s)} s less "
            f"{_seconds(self.visibility_timeout_s - self.limit_s)} s kept for the run after the ETA)"
        )

    def detail(self) -> str:
        """:meth:`summary`, why, and what to do instead."""
        return (f"{self.summary()}: a message held longer than visibility_timeout_s is handed to another worker by "
                "the Redis broker and would run twice. Send it closer to its time, or raise visibility_timeout_s")


def _seconds(value: float) -> str:
    return f"{value:.0f}" if value == math.floor(value) else f"{value:.1f}"


def eta_too_far(eta: Any, *, now_unix_s: float, visibility_timeout_s: float) -> EtaTooFar | None:
    """:class:`EtaTooFar` when ``eta`` (the ``eta`` header's value) is more than :func:`max_eta_ahead_s` ahead
    of ``now_unix_s`` (Unix s); None when it is within (exactly at the limit is within), null, in the past, or
    not a time at all (the header checks name that)."""
    if not isinstance(eta, str) or not eta:
        return None
    try:
        eta_s = eta_unix_s(eta)
    except ValueError:
        return None
    if eta_s - now_unix_s <= max_eta_ahead_s(visibility_timeout_s):
        return None
    return EtaTooFar(eta, eta_s, now_unix_s, visibility_timeout_s)


def item_eta_too_far(item: bytes, *, now_unix_s: float, visibility_timeout_s: float) -> EtaTooFar | None:
    """:func:`eta_too_far` for the ``eta`` header of a raw queue item (a kombu envelope, as a dead-letter entry
    keeps it); None when the item cannot be read. Never raises."""
    try:
        doc = _kombu_loads(item)  # type: ignore[no-untyped-call]
        headers = doc.get("headers") if isinstance(doc, dict) else None
        eta = headers.get("eta") if isinstance(headers, dict) else None
    except Exception:  # a dead-letter entry's item may be anything at all
        return None
    return eta_too_far(eta, now_unix_s=now_unix_s, visibility_timeout_s=visibility_timeout_s)
