"""The request ledger: the fleet's promises about every request, checked against Redis after a run.

A fault test, a fuzzer or a soak records what its callers were told (:meth:`Ledger.accepted`,
:meth:`Ledger.refused`), lets the ledger look at stored results while the run goes on
(:meth:`Ledger.observe`), and ends with :meth:`Ledger.check`. The promises
(docs/reliability.md, "The ledger"):

* ``not_terminal`` / ``lost``: every accepted ID reaches a terminal state — a result stored under its
  ID in a ready state (``SUCCESS``, ``FAILURE``, ``REVOKED``; a dead-lettered message with an ID gets
  its ``FAILURE`` there too). One with no such result is ``not_terminal`` while its message still
  sits in a queue list or kombu's unacked hash, and ``lost`` when it is in neither: nothing will ever
  bring it back.
* ``terminal_changed``: a stored terminal state never changes: the first one seen (state + sha256 of
  its stored document, minus the volatile ``date_done``) is the one at the end.
* ``refused_ran``: an ID whose submit was refused ("nothing was queued") never runs and never queues.
* ``cancel_overridden``: an ID cancelled for good (its cancel mark written before any worker took it, which every
  reader then calls ``cancelled``: :mod:`protocol.cancel_marks`) never ends ``SUCCESS``.
* ``stream_open``: every streamed ID's Redis Stream ends with its ``final`` or ``error`` event.
* ``unacked_left``, ``queued_left``, ``held``: nothing is left behind: kombu's unacked hash is empty,
  the given queues are empty, and no live worker's heartbeat reports requests in flight.

The checker only reads Redis (a few commands per ID), so it runs the same against any fleet.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from producer.result_waiter import READY_STATES
from protocol.cancel_marks import cancelled_for_good
from protocol.errors import DecodeError
from protocol.keys import CANCEL_KEY, RESULT_KEY, STREAM_KEY, WORKER_KEY_PREFIX
from protocol.streams import decode_events

__all__ = ["Ledger", "LedgerReport", "LedgerViolationError", "Violation"]

UNACKED_KEY = "unacked"
"""kombu's Redis transport default ``unacked_key`` (the fleet does not change it)."""
PRIORITY_SEP = "\x06\x16"
"""kombu's separator between a queue name and its priority suffix."""
VOLATILE_META_FIELDS = ("date_done",)
"""Fields of Celery's result document that a rewrite of the same outcome may change."""


@dataclass(frozen=True)
class Violation:
    """One broken promise: its kind (see the module docstring), the request ID when it has one."""

    kind: str
    request_id: str | None
    detail: str


@dataclass(frozen=True)
class LedgerReport:
    """What :meth:`Ledger.check` found. ``terminal`` counts accepted IDs by their stored state."""

    accepted: int
    refused: int
    streamed: int
    terminal: dict[str, int]
    violations: tuple[Violation, ...]

    @property
    def ok(self) -> bool:
        """True when every promise held."""
        return not self.violations

    def kinds(self) -> Counter[str]:
        """Violations counted by kind."""
        return Counter(v.kind for v in self.violations)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready summary (violations listed up to 50)."""
        return {
            "accepted": self.accepted,
            "refused": self.refused,
            "streamed": self.streamed,
            "terminal": dict(self.terminal),
            "violations_by_kind": dict(self.kinds()),
            "violations": [v.__dict__ for v in self.violations[:50]],
        }

    def raise_if_broken(self) -> None:
        """Raises :class:`LedgerViolationError` listing the violations, when there are any."""
        if self.violations:
            raise LedgerViolationError(self)


class LedgerViolationError(AssertionError):
    """The fleet broke a promise about some requests (the report is attached)."""

    def __init__(self, report: LedgerReport) -> None:
        shown = "\n".join(f"  {v.kind} {v.request_id or '-'}: {v.detail}" for v in report.violations[:20])
        more = len(report.violations) - 20
        super().__init__(
            f"ledger: {len(report.violations)} violation(s) {dict(report.kinds())}\n{shown}"
            + (f"\n  … and {more} more" if more > 0 else "")
        )
        self.report = report


@dataclass
class Ledger:
    """Records what callers were told and checks the fleet's state against it (see the module docstring).

    ``queues``: the Celery queue names the run used (their priority lists are included).
    """

    client: redis.Redis[bytes]
    queues: Sequence[str] = ()
    _accepted: dict[str, bool] = field(default_factory=dict)
    _refused: set[str] = field(default_factory=set)
    _first_terminal: dict[str, tuple[str, str]] = field(default_factory=dict)
    _changes: list[Violation] = field(default_factory=list)

    def accepted(self, request_id: str, *, streamed: bool = False) -> None:
        """The caller got ``request_id`` back: the fleet now owes it a terminal state (and a stream end)."""
        self._accepted[request_id] = self._accepted.get(request_id, False) or streamed

    def refused(self, request_id: str) -> None:
        """The caller was told ``request_id`` was not queued (the submit raised, or answered 4xx/5xx)."""
        self._refused.add(request_id)

    def observe(self, request_ids: Iterable[str] | None = None) -> int:
        """Read the stored results of ``request_ids`` (default: every accepted ID) and remember the first
        terminal state of each; a later one that differs is a ``terminal_changed`` violation.
        Returns how many were terminal."""
        ids = list(self._accepted if request_ids is None else request_ids)
        terminal = 0
        for rid, seen in zip(ids, self._read_terminal(ids), strict=True):
            if seen is None:
                continue
            terminal += 1
            first = self._first_terminal.setdefault(rid, seen)
            if first != seen:
                self._changes.append(
                    Violation("terminal_changed", rid, f"stored {first[0]} (sha256 {first[1][:12]}) became "
                              f"{seen[0]} (sha256 {seen[1][:12]})")
                )
                self._first_terminal[rid] = seen
        return terminal

    def wait_terminal(self, timeout_s: float, poll_s: float = 0.1) -> bool:
        """Wait until every accepted ID has a terminal state, or ``timeout_s`` passes (then False).
        Observes as it goes, so a result that changes while waiting is caught."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.observe() == len(self._accepted):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)  # polling Redis for a condition, with a deadline

    def check_settled(self, timeout_s: float, poll_s: float = 0.2) -> LedgerReport:
        """:meth:`check` until it passes or ``timeout_s`` passes; returns the last report.

        For the end of a run on a live fleet: an ack lands just after its result, a heartbeat reports
        in-flight work up to one period late. ``lost`` and ``terminal_changed`` never clear by waiting."""
        deadline = time.monotonic() + timeout_s
        while True:
            report = self.check()
            if report.ok or time.monotonic() >= deadline:
                return report
            time.sleep(poll_s)  # polling Redis for a condition, with a deadline

    def check(self) -> LedgerReport:
        """Check every promise now (after the run has settled) and report."""
        self.observe()
        violations = list(self._changes)
        queued, unacked = self._messages_left()
        terminal: Counter[str] = Counter()
        for rid in self._accepted:
            state = self._first_terminal.get(rid)
            if state is not None:
                terminal[state[0]] += 1
            elif rid in queued or rid in unacked:
                where = "a queue" if rid in queued else "kombu's unacked hash"
                violations.append(Violation("not_terminal", rid, f"no result; its message is still in {where}"))
            else:
                violations.append(Violation("lost", rid, "no result, and its message is in no queue and not unacked"))
        violations += self._refused_that_ran(queued, unacked)
        violations += self._cancels_overridden()
        violations += self._open_streams()
        violations += self._left_behind(queued, unacked)
        return LedgerReport(
            accepted=len(self._accepted),
            refused=len(self._refused),
            streamed=sum(self._accepted.values()),
            terminal=dict(terminal),
            violations=tuple(violations),
        )

    # -- reading Redis -------------------------------------------------------------------------------

    def _read_terminal(self, ids: Sequence[str]) -> list[tuple[str, str] | None]:
        """(state, sha256 of the stored document minus volatile fields) per ID, None when not terminal."""
        out: list[tuple[str, str] | None] = []
        for start in range(0, len(ids), 500):
            chunk = ids[start : start + 500]
            raws = self.client.mget([RESULT_KEY.format(id=rid) for rid in chunk]) if chunk else []
            for raw in raws:
                out.append(_terminal_of(raw))
        return out

    def _messages_left(self) -> tuple[dict[str, str], dict[str, str]]:
        """Task IDs of the messages still in the queues (-> list key) and in kombu's unacked hash (-> tag)."""
        queued: dict[str, str] = {}
        for key in self._queue_keys():
            for raw in self.client.lrange(key, 0, -1):
                tid = _task_id_of(raw)
                if tid is not None:
                    queued[tid] = key
        unacked: dict[str, str] = {}
        for tag, raw in self.client.hgetall(UNACKED_KEY).items():
            try:
                entry = json.loads(raw)
            except ValueError:
                continue
            tid = _task_id_of(json.dumps(entry[0]).encode()) if isinstance(entry, list) and entry else None
            unacked[tid or f"<unreadable entry {tag!r}>"] = tag.decode(errors="replace")
        return queued, unacked

    def _queue_keys(self) -> list[str]:
        keys: list[str] = []
        for queue in self.queues:
            keys.append(queue)
            for key in self.client.scan_iter(match=_glob_escape(queue + PRIORITY_SEP) + "*", count=500):
                keys.append(key.decode(errors="replace"))
        return keys

    def _refused_that_ran(self, queued: dict[str, str], unacked: dict[str, str]) -> list[Violation]:
        found: list[Violation] = []
        refused = sorted(self._refused - set(self._accepted))
        for rid, seen in zip(refused, self._read_terminal(refused), strict=True):
            if seen is not None or rid in queued or rid in unacked:
                what = f"its result is stored ({seen[0]})" if seen else "its message is queued"
                found.append(Violation("refused_ran", rid, f"the caller was told nothing was queued, yet {what}"))
        return found

    def _cancels_overridden(self) -> list[Violation]:
        """``cancel_overridden``: a SUCCESS stored for an ID whose cancel mark says cancelled for good."""
        ids = [rid for rid in self._accepted if (self._first_terminal.get(rid) or ("",))[0] == "SUCCESS"]
        found: list[Violation] = []
        for start in range(0, len(ids), 500):
            chunk = ids[start : start + 500]
            for rid, mark in zip(chunk, self.client.mget([CANCEL_KEY.format(id=rid) for rid in chunk]), strict=True):
                if cancelled_for_good(mark):
                    found.append(Violation("cancel_overridden", rid, "cancelled for good (read as cancelled), yet "
                                           "its result was stored as SUCCESS"))  # fmt: skip
        return found

    def _open_streams(self) -> list[Violation]:
        found: list[Violation] = []
        for rid, streamed in self._accepted.items():
            if not streamed:
                continue
            last = self.client.xrevrange(STREAM_KEY.format(id=rid), count=1)
            if not last:
                found.append(Violation("stream_open", rid, "its stream has no events at all"))
                continue
            try:
                event = decode_events(last[0][1])[-1]  # a coalesced entry ends with its last event
            except DecodeError as exc:  # an undecodable last entry is itself a broken stream
                found.append(Violation("stream_open", rid, f"its last entry does not decode: {exc}"))
                continue
            if not event.is_last:
                found.append(Violation("stream_open", rid, f"its stream stops at token {event.index}, no final event"))
        return found

    def _left_behind(self, queued: dict[str, str], unacked: dict[str, str]) -> list[Violation]:
        found = [Violation("unacked_left", rid, f"unacked delivery tag {tag}") for rid, tag in unacked.items()]
        found += [Violation("queued_left", rid, f"still in {key!r}") for rid, key in queued.items()]
        for key in self.client.scan_iter(match=WORKER_KEY_PREFIX + "*", count=200):
            raw = self.client.get(key)
            if not raw:
                continue
            doc = json.loads(raw)
            in_flight = int(doc.get("in_flight") or 0)
            if in_flight:
                found.append(Violation("held", None, f"worker {doc.get('hostname')} reports {in_flight} in flight"))
        return found


def _terminal_of(raw: bytes | None) -> tuple[str, str] | None:
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        return ("UNREADABLE", hashlib.sha256(raw).hexdigest())
    state = doc.get("status") if isinstance(doc, dict) else None
    if state not in READY_STATES:
        return None
    stable = {k: v for k, v in doc.items() if k not in VOLATILE_META_FIELDS}
    digest = hashlib.sha256(json.dumps(stable, sort_keys=True).encode()).hexdigest()
    return (str(state), digest)


def _task_id_of(raw: bytes) -> str | None:
    """The Celery task ID in a kombu message's headers (protocol 2), or None."""
    try:
        doc = json.loads(raw)
        tid = doc["headers"]["id"]
    except (ValueError, KeyError, TypeError):
        return None
    return tid if isinstance(tid, str) else None


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
