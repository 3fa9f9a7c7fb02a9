"""The bookkeeping of the requests a worker holds, written again where Redis lost it.

Between its take and its stored result, what says a request exists lives in two keys the worker does not
write again by itself: its submit marker ``fleet:req:<id>`` (:mod:`protocol.request_marker`: "queued", and
the kind that ``cancel`` reads) and, for a generation (or any request with ``celery.track_started``), its
STARTED state ``celery-task-meta-<id>`` ("running"). A Redis restart without persistence, or a flush, loses
both while the worker runs on: until its result was stored, ``FleetClient.status`` said ``not_found``,
``GET /v1/requests/{id}`` answered 404 and ``cancel`` raised ``RequestNotFound``.

So the worker registers each request it holds (:meth:`HeldRequests.hold`, from the task thread, once the
request is decoded; :meth:`HeldRequests.release` once its task is done) and every heartbeat
(:attr:`workers.health.Heartbeat.on_beat`) runs :data:`RESTORE_SCRIPT` once for all of them: one round trip
that writes a key only where it is absent, so nothing present is ever touched, and a stored outcome
(SUCCESS, FAILURE, REVOKED: immutable, :mod:`broker.result_backend`) never turns back into STARTED. A request
reads as it did before the loss within one heartbeat period of Redis answering again (a generation
``running``, and a cancel then stops it; a one-step request without a STARTED state ``queued``, as before).
A worker that holds nothing sends nothing; one that holds requests costs Redis one script run per
heartbeat, its reads only while nothing is lost.

A request whose task message carried its owner (the gateway's ``fleet_owners`` header, :mod:`gateway.request_owners`)
gets its owner mark ``fleet:owner:<id>`` written back too, where absent, in the same round trip and before its
marker (a marker without its mark reads as every API key's request: another key could read and cancel it).
So does every held request's taken note ``fleet:taken:<id>`` (:mod:`protocol.cancel_marks`): without it, a
cancel after the loss would be for good, read "cancelled" at once, while the worker runs the request on.

The marker written is the producer's (same request, same JSON); a request queued without one (a plain
Celery client's) gets one too, and reads from then on as one the fleet queued (logged at DEBUG: only a
lost STARTED state is logged as a warning). The STARTED state is
Celery's, without ``result_extended``'s fields.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
from celery import current_task

from broker import message_owners
from protocol.keys import OWNER_KEY, REQUEST_KEY, RESULT_KEY, TAKEN_KEY
from protocol.messages import InferenceRequest
from protocol.request_marker import request_marker

__all__ = ["RESTORE_MARKS_SCRIPT", "RESTORE_SCRIPT", "HeldRequest", "HeldRequests", "restore_call", "started_meta"]

log = logging.getLogger("fleet.worker")

RESTORE_SCRIPT = """
local ttl, restored, started = ARGV[1], 0, 0
local function absent(key) return redis.call('EXISTS', key) == 0 end
for i = 1, #KEYS / 2 do
  local wrote = false
  if absent(KEYS[2 * i - 1]) then
    redis.call('SET', KEYS[2 * i - 1], ARGV[2 * i], 'EX', ttl)
    wrote = true
  end
  if ARGV[2 * i + 1] ~= '' and absent(KEYS[2 * i]) then
    redis.call('SET', KEYS[2 * i], ARGV[2 * i + 1], 'EX', ttl)
    wrote = true
    started = started + 1
  end
  if wrote then restored = restored + 1 end
end
return {restored, started}
"""
"""Write back whatever of the held requests' bookkeeping Redis lost. KEYS: per request its marker key, then
its result key; ARGV[1]: time to live (s), then per request its marker JSON and its STARTED meta ('' when
none was stored for it). Each key is written only where it is absent: ``EXISTS`` then ``SET``, as atomic as
``SET NX`` inside one script, and a beat that finds every key in place writes nothing (no ``SET`` to count
among a request's state writes). Returns [requests with a key written, requests whose STARTED state was
written]."""


RESTORE_MARKS_SCRIPT = """
local written = 0
for i = 1, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then
    redis.call('SET', KEYS[i], ARGV[i + 1], 'EX', ARGV[1])
    written = written + 1
  end
end
return written
"""
"""Write back the owner marks Redis lost of the held requests whose message carried one: KEYS, their marks;
ARGV[1], time to live (s), then each owner. Run before :data:`RESTORE_SCRIPT` in the same round trip, so a
marker written back never stands without its mark; a beat that finds every mark writes nothing."""


def started_meta(request_id: str, *, pid: int, hostname: str) -> str:
    """The STARTED state of ``request_id`` as Celery's Redis backend stores it (JSON), with the worker's
    ``pid`` and node name as ``update_state`` and ``track_started`` give them."""
    return json.dumps({"status": "STARTED", "result": {"pid": pid, "hostname": hostname}, "traceback": None,
                       "children": [], "date_done": None, "task_id": request_id})  # fmt: skip


@dataclass
class HeldRequest:
    """One request a worker holds: what its bookkeeping is, built on the first beat that needs it."""

    request_id: str
    request: InferenceRequest
    started_by: str | None
    """The node name that stored its STARTED state; None when none was stored (a one-step request with
    ``celery.track_started`` off, a request of a bulk message)."""
    owner: str = ""
    """Its owner mark, as its task message carried it ('' : none)."""
    _values: tuple[str, str] | None = field(default=None, repr=False)

    def values(self, pid: int) -> tuple[str, str]:
        """Its marker JSON and STARTED meta ('' when none), built once (no cost on the request's own path)."""
        if self._values is None:
            started = "" if self.started_by is None else started_meta(self.request_id, pid=pid,
                                                                        hostname=self.started_by)  # fmt: skip
            self._values = (request_marker(self.request), started)
        return self._values


def restore_call(held: Sequence[HeldRequest], ttl_s: int, pid: int) -> tuple[list[str], list[str | int]]:
    """The KEYS and ARGV of one :data:`RESTORE_SCRIPT` run for ``held``."""
    keys: list[str] = []
    args: list[str | int] = [ttl_s]
    for h in held:
        keys += [REQUEST_KEY.format(id=h.request_id), RESULT_KEY.format(id=h.request_id)]
        args += h.values(pid)
    return keys, args


class HeldRequests:
    """The requests this worker process holds (thread-safe), and their bookkeeping written back each beat."""

    def __init__(self, client: redis.Redis[bytes], *, ttl_s: int) -> None:
        """``ttl_s``: the life of what is written back (``result_ttl_s``, as the producer's marker and
        Celery's result)."""
        self._client = client
        self._script: Any = client.register_script(RESTORE_SCRIPT)
        self._marks: Any = client.register_script(RESTORE_MARKS_SCRIPT)
        self.ttl_s = ttl_s
        self._held: dict[str, HeldRequest] = {}
        self._lock = threading.Lock()
        self.restored = 0
        """Requests whose bookkeeping was written back so far."""

    def hold(self, request_id: str, request: InferenceRequest, *, started_by: str | None) -> None:
        """Count ``request_id`` as held until :meth:`release`; ``started_by``: the node name that stored its
        STARTED state (None when none was stored). Called from its task's thread: its owner is read from the
        task message's header (:func:`broker.message_owners`)."""
        owner = message_owners(getattr(current_task, "request", None)).get(request_id, "")
        entry = HeldRequest(request_id, request, started_by, owner)
        with self._lock:
            self._held[request_id] = entry

    def release(self, request_id: str) -> None:
        """``request_id``'s task is done (its result stored, or not to be)."""
        with self._lock:
            self._held.pop(request_id, None)

    def held(self) -> list[HeldRequest]:
        """The requests held now."""
        with self._lock:
            return list(self._held.values())

    def restore(self, _expires_unix_s: float = 0.0) -> None:
        """Write back the held requests' lost bookkeeping in one round trip (a heartbeat hook: the argument,
        the heartbeat's expiry, is not used), counted in :attr:`restored`.

        Raises:
            redis.RedisError: Redis did not answer, or refused (the heartbeat logs it; the next beat tries again).
        """
        held = self.held()
        if not held:
            return
        keys, args = restore_call(held, self.ttl_s, os.getpid())
        owned = [h for h in held if h.owner]
        with self._client.pipeline(transaction=False) as pipe:  # each mark before its marker, in one round trip
            self._marks(keys=[*(TAKEN_KEY.format(id=h.request_id) for h in held),
                              *(OWNER_KEY.format(id=h.request_id) for h in owned)],
                        args=[self.ttl_s, *("1" for _ in held), *(h.owner for h in owned)], client=pipe)  # fmt: skip
            self._script(keys=keys, args=args, client=pipe)
            counts = pipe.execute()[-1]
        restored, started = (int(n) for n in counts)
        if not restored:
            return
        self.restored += restored
        # a lost STARTED state means Redis lost data; a marker alone is also absent for a request a plain Celery
        # client queued (it never had one), which is no news
        level = logging.WARNING if started else logging.DEBUG
        log.log(level, "Redis lacked the marker or STARTED state of %d of the %d requests this worker holds (a "
                "restart without persistence, a flush, or a request queued without a marker): written again",
                restored, len(held))  # fmt: skip
