"""One request ID names one body, on every submit path: claim the IDs and queue their tasks in one Redis step.

Every submit (``FleetClient.send``, ``send_batch``, ``submit_many``, ``submit_bulk``, the gateway's
native routes, the ``fleet`` CLI) goes through :class:`IdempotentQueue`. For all the requests of
one call it runs :data:`CLAIM_AND_QUEUE_LUA`, which, atomically:

1. claims each request's marker ``fleet:req:<id>`` with ``SET NX EX result_ttl_s`` (the marker
   holds the body's fingerprint, :func:`request_fingerprint`);
2. finds each ID already known: a marker with another fingerprint is a conflict, and then nothing
   at all is written (markers claimed in this step are deleted again) and
   :class:`~protocol.errors.IdempotencyConflict` names the request; a marker with the same
   fingerprint, or a stored result whose marker has expired, is the same request, never queued again;
3. only when every ID is as the caller expected (new ones carry their task, known ones none),
   ``LPUSH``es the tasks and ``PUBLISH``es their task-sent events; otherwise it writes nothing and
   says which IDs are known, and the caller builds the tasks of the new ones and runs it again.

So a call is queued all or none, a concurrent submit of the same ID cannot interleave (Redis runs
a script alone), and an ID never names two inputs, duplicates inside one call included
(:func:`one_body_per_id` refuses those before Redis is asked). Where tasks cannot be written as
raw envelopes (a broker with a key prefix, not plain Redis: ``TaskWriter.usable`` False), the
script claims the markers alone, then Celery's ``send_task`` queues one message at a time: the
check is still whole and atomic, the queueing is not. A send that fails frees the claims of the
requests it had not sent; where Redis is what failed and they cannot be freed then, the client
frees them before it claims those IDs again, so a resubmit through it queues them (from another
process they read as known until ``result_ttl_s`` ends them).

A call that set its requests' owners (the gateway, :func:`producer.task_writer.owners_in_messages`, after claiming
their owner marks) writes ``"owned": true`` in the markers it claims. Where the script finds an ID known whose mark
this call claimed (it was unknown then) and the marker does not say ``owned``, a caller without an owner (a
``FleetClient``, the CLI) queued that ID in between: the script deletes the mark in the same step, so the request
stays every key's, as one queued before the claim is; a call of the same owner that queued it in between left
``owned`` and the mark stays. ``FleetClient.send``'s look-up of a known ID before admission does the same
(:meth:`IdempotentQueue.settle_known`).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from typing import Any

import redis
from celery import Celery

from producer.task_writer import TaskMessage, TaskWriter, call_owners
from protocol.errors import IdempotencyConflict
from protocol.keys import OWNER_KEY, REQUEST_KEY
from protocol.messages import InferenceRequest
from protocol.request_marker import request_fingerprint, request_marker

__all__ = [
    "CLAIM_AND_QUEUE_LUA",
    "MAX_CLAIM_ATTEMPTS",
    "SETTLE_KNOWN_LUA",
    "IdempotentQueue",
    "conflict",
    "one_body_per_id",
    "quiet_backend",
    "request_fingerprint",
]

NEW, KNOWN, EITHER = "n", "k", "?"
"""A request's expected (and found) state in the script: new (its task is in this call), known, either."""

MAX_CLAIM_ATTEMPTS = 5
"""Script runs per call before giving up: a rerun happens only when a marker appeared or expired in between."""

CLAIM_AND_QUEUE_LUA = """
-- KEYS: n request markers, then n result keys, then n owner marks, then m queue lists
-- ARGV: ttl_s, n, m; n markers; n fingerprints; n expected states (n/k/?); n owners whose mark this call claimed
-- ('' for none); m x (envelope, channel, event)
local ttl, n, m = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local claimed, states, rerun, unowned = {}, {}, false, {}
local function release()
  for _, key in ipairs(claimed) do redis.call('DEL', key) end
end
for i = 1, n do
  local state = 'k'
  if redis.call('SET', KEYS[i], ARGV[3 + i], 'NX', 'EX', ttl) then
    if redis.call('EXISTS', KEYS[n + i]) == 1 then
      redis.call('DEL', KEYS[i])  -- a stored result outlived its marker: the ID is known, never run again
    else
      claimed[#claimed + 1] = KEYS[i]
      state = 'n'
    end
  else
    local ok, known = pcall(cjson.decode, redis.call('GET', KEYS[i]))
    local fingerprint = ok and type(known) == 'table' and known['fingerprint'] or nil
    if type(fingerprint) == 'string' and fingerprint ~= ARGV[3 + n + i] then
      release()
      return {'conflict', tostring(i)}
    end
    -- a mark this call claimed on an ID queued since by a caller without an owner: that request is not the
    -- owner's (a call of the same owner that queued it says so in its marker)
    if ARGV[3 + 3 * n + i] ~= '' and not (ok and type(known) == 'table' and known['owned'] == true) then
      unowned[#unowned + 1] = i
    end
  end
  states[i] = state
  local expected = ARGV[3 + 2 * n + i]
  if expected ~= '?' and expected ~= state then rerun = true end
end
for _, i in ipairs(unowned) do
  if redis.call('GET', KEYS[2 * n + i]) == ARGV[3 + 3 * n + i] then redis.call('DEL', KEYS[2 * n + i]) end
end
if rerun then
  release()
  return {'rerun', table.concat(states)}
end
local base = 3 + 4 * n
for j = 1, m do
  redis.call('LPUSH', KEYS[3 * n + j], ARGV[base + 3 * j - 2])
  if ARGV[base + 3 * j] ~= '' then redis.call('PUBLISH', ARGV[base + 3 * j - 1], ARGV[base + 3 * j]) end
end
return {'ok', table.concat(states)}
"""

SETTLE_KNOWN_LUA = """
-- KEYS: a request marker, its owner mark; ARGV: the owner whose mark this call claimed
-- the mark goes where the ID is queued and its marker does not say an owner's call queued it (as the queue script)
local ok, known = pcall(cjson.decode, redis.call('GET', KEYS[1]))
if ok and type(known) == 'table' and known['owned'] ~= true and redis.call('GET', KEYS[2]) == ARGV[1] then
  return redis.call('DEL', KEYS[2])
end
return 0
"""


def conflict(request_id: str, label: str = "") -> IdempotencyConflict:
    """The error for ``request_id`` sent with another body than the one it names; ``label`` places it
    in a call of many (``"requests[2]"``: the field becomes ``requests[2].request_id``)."""
    where = f"{label}: " if label else ""
    return IdempotencyConflict(
        f"{where}request_id {request_id!r} is already known with a different body; nothing was queued "
        "(an idempotency key names one request: reuse it only to resubmit the same request)",
        f"{label}.request_id" if label else "request_id",
        None,
    )


def one_body_per_id(ids: Sequence[str], fingerprints: Sequence[str], label: Callable[[int], str]) -> list[int]:
    """For each position, the first position with the same ID (itself when the ID is new in the call).

    Raises:
        IdempotencyConflict: an ID appears twice with different bodies (named by ``label(i)`` of the later).
    """
    first: dict[str, int] = {}
    out: list[int] = []
    for i, (rid, fingerprint) in enumerate(zip(ids, fingerprints, strict=True)):
        j = first.setdefault(rid, i)
        if fingerprints[j] != fingerprint:
            raise conflict(rid, label(i))
        out.append(j)
    return out


def _owned(marker: str, owned: bool) -> str:
    """``marker`` (:func:`protocol.request_marker.request_marker`) saying ``"owned": true`` where the request is
    queued by a call that set its owner (the gateway), so a later call of that owner that finds it known keeps its
    mark (:data:`CLAIM_AND_QUEUE_LUA`)."""
    return json.dumps({**json.loads(marker), "owned": True}) if owned else marker


def _no_send_time_subscription(producer: Any, task_id: str) -> None:
    """Replaces the result backend's ``on_task_call``: subscribe on wait only (see :func:`quiet_backend`)."""


def quiet_backend(app: Celery) -> None:
    """Stop this thread's result backend from subscribing to a task's result channel as it is sent.

    Celery subscribes on send, and the AsyncResult that ``send_task`` returns (dropped by the fleet)
    unsubscribes at once: 2 wasted Redis commands per request. ``ResultReader.result`` subscribes when
    it waits, then reads the stored result once, so a result published in between is not missed.
    Celery keeps one Redis result backend per thread (it is not ``thread_safe``), hence per call.
    """
    backend = app.backend
    if vars(backend).get("on_task_call") is not _no_send_time_subscription:
        backend.on_task_call = _no_send_time_subscription


BuildTasks = Callable[[list[int]], list[TaskMessage]]
"""Given the positions of the requests that are new, the task messages that carry them."""

SendTasks = Callable[[list[int], list[int]], None]
"""Queue the new requests at these positions with Celery's ``send_task`` (their IDs are already
claimed), appending each position to the second list once its message is sent."""


class IdempotentQueue:
    """Claims request IDs and queues their tasks in one atomic Redis step (see the module docstring)."""

    def __init__(self, client: redis.Redis[bytes], app: Celery, writer: TaskWriter, result_ttl_s: int) -> None:
        self.redis = client
        self.app = app
        self.writer = writer
        self.result_ttl_s = result_ttl_s
        self._script = client.register_script(CLAIM_AND_QUEUE_LUA)
        self._settle = client.register_script(SETTLE_KNOWN_LUA)
        self._lock = threading.Lock()
        self._unfreed: dict[str, str] = {}
        """Request ID -> its marker: claims of this client whose send failed and that Redis could not free then."""

    def queue(
        self,
        requests: Sequence[InferenceRequest],
        build: BuildTasks,
        send: SendTasks,
        *,
        label: Callable[[int], str] = lambda _: "",
    ) -> list[bool]:
        """Queue every request of ``requests`` not yet known, all or none; True where it was new.

        The tasks come from ``build`` (raw envelopes, written by the script itself) when the task
        writer is usable, else from ``send`` after the script claimed the markers alone (a failed
        send frees the markers of the requests it had not sent).

        Raises:
            IdempotencyConflict: an ID is known, or repeated in ``requests``, with another body;
                nothing was queued, no marker written. Named by ``label(i)``.
            redis.RedisError: Redis failed (the script wrote everything or nothing), or markers
                kept changing for :data:`MAX_CLAIM_ATTEMPTS` runs.
        """
        ids = [str(r.request_id) for r in requests]
        if self._unfreed:
            self._free_left_claims(ids)
        fingerprints = [request_fingerprint(r) for r in requests]
        firsts = one_body_per_id(ids, fingerprints, label)
        unique = [i for i, j in enumerate(firsts) if i == j]
        owners, claimed_now = call_owners()
        markers = [_owned(request_marker(requests[i], fingerprints[i]), ids[i] in owners) for i in unique]
        drops = [owners.get(ids[i], "") if ids[i] in claimed_now else "" for i in unique]
        if not self.writer.usable():
            _, states = self._run(ids, unique, fingerprints, markers, drops, [EITHER] * len(unique), [], label)
            new = [i for i, s in zip(unique, states, strict=True) if s == NEW]
            self._send_claimed(ids, dict(zip(unique, markers, strict=True)), new, send)
            return [i in set(new) for i in range(len(requests))]
        expected = [NEW] * len(unique)
        for _ in range(MAX_CLAIM_ATTEMPTS):
            new = [i for i, s in zip(unique, expected, strict=True) if s == NEW]
            tasks = build(new) if new else []
            verdict, states = self._run(ids, unique, fingerprints, markers, drops, expected, tasks, label)
            if verdict == "ok" or NEW not in states:  # all written, or every ID is known: nothing to write
                fresh = {i for i, s in zip(unique, states, strict=True) if s == NEW}
                return [i in fresh for i in range(len(requests))]
            expected = list(states)
        raise redis.RedisError(
            f"request markers changed during {MAX_CLAIM_ATTEMPTS} attempts to queue {len(unique)} requests; "
            "nothing was queued: try again"
        )

    def _run(
        self,
        ids: list[str],
        unique: list[int],
        fingerprints: list[str],
        markers: list[str],
        drops: list[str],
        expected: list[str],
        tasks: list[TaskMessage],
        label: Callable[[int], str],
    ) -> tuple[str, list[str]]:
        """One run of the script: ("ok" | "rerun", each unique request's state found). ``drops[k]``: the owner
        whose mark this call claimed for unique request k ("" for none)."""
        keys = [REQUEST_KEY.format(id=ids[i]) for i in unique]
        keys += [self.app.backend.get_key_for_task(ids[i]).decode() for i in unique]
        keys += [OWNER_KEY.format(id=ids[i]) for i in unique]
        keys += [t.queue for t in tasks]
        argv: list[Any] = [self.result_ttl_s, len(unique), len(tasks), *markers]
        argv += [fingerprints[i] for i in unique]
        argv += expected
        argv += drops
        for t in tasks:
            argv += [t.envelope, t.channel, t.event]
        verdict, detail = (part.decode() for part in self._script(keys=keys, args=argv))
        if verdict == "conflict":
            i = unique[int(detail) - 1]
            raise conflict(ids[i], label(i))
        return verdict, list(detail)

    def settle_known(self, request_id: str) -> None:
        """For an ID found known outside the queue step (``FleetClient.send``'s look-up before admission): delete
        the owner mark this call claimed (:func:`producer.task_writer.owners_in_messages`) where the ID's marker
        says no owner's call queued it, as the queue step does (:data:`SETTLE_KNOWN_LUA`). Nothing for an ID whose
        mark this call did not claim.

        Raises:
            redis.RedisError: Redis failed (the mark is left as it is).
        """
        owners, claimed_now = call_owners()
        if request_id in claimed_now and request_id in owners:
            keys = [REQUEST_KEY.format(id=request_id), OWNER_KEY.format(id=request_id)]
            self._settle(keys=keys, args=[owners[request_id]])

    def _send_claimed(self, ids: list[str], markers: dict[int, str], new: list[int], send: SendTasks) -> None:
        """Queue the claimed requests with ``send``; on a failure, free the markers of those not sent."""
        sent: list[int] = []
        try:
            if new:
                send(new, sent)
        except Exception:
            done = set(sent)
            self._forget(ids, markers, [i for i in new if i not in done])
            raise

    def _forget(self, ids: list[str], markers: dict[int, str], positions: list[int]) -> None:
        """Delete these claims' own markers (best effort) so that a retry with their IDs can queue them; those
        Redis cannot delete now are kept, to be deleted before their IDs are claimed again."""
        for i in positions:
            key = REQUEST_KEY.format(id=ids[i])
            try:
                if self.redis.get(key) == markers[i].encode():
                    self.redis.delete(key)
            except redis.RedisError:  # Redis is what failed: freed at this client's next claim of the ID
                with self._lock:
                    self._unfreed[ids[i]] = markers[i]

    def _free_left_claims(self, ids: list[str]) -> None:
        """Free this client's claims of ``ids`` that a failed send left (see :meth:`_forget`).

        Raises:
            redis.RedisError: Redis still fails (the claims are kept for the next try).
        """
        with self._lock:
            left = {rid: self._unfreed[rid] for rid in dict.fromkeys(ids) if rid in self._unfreed}
        for rid, marker in left.items():
            key = REQUEST_KEY.format(id=rid)
            if self.redis.get(key) == marker.encode():
                self.redis.delete(key)
            with self._lock:
                self._unfreed.pop(rid, None)
