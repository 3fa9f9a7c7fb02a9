"""Which API key a request submitted through the gateway belongs to: ``fleet:owner:<id>``
(:data:`protocol.keys.OWNER_KEY`) holds its owner (:func:`gateway.auth.owner_of`: a keyed digest of the key,
never the key), written before the request is queued, with the request's result time to live
(``result_ttl_s``; the worker gives it the result's TTL again when it stores the result, as it does the
submit marker, :mod:`broker.result_backend`). The task message carries the owner in a header workers need
nothing of (a message without it has no owner).

* A mark is claimed only for an ID nobody knows yet (no mark, no submit marker, no stored result), in the
  one Redis step that reads the marks of every ID of the call (:data:`CLAIM_OWNERS_LUA`): the mark exists
  before the marker does, so a reader never finds a queued request without its mark.
* An ID known without a mark (submitted by ``FleetClient``, the CLI or a plain Celery client straight to
  Redis, or before marks were kept) stays without one: any accepted key reads it.
* An ID whose mark names another key is refused before anything is queued, with the same 409 whatever the
  body (:func:`taken`): another key cannot read, take over or probe the first key's request.
* The task message of a request queued with a mark carries its owner (``fleet_owners`` header,
  :mod:`producer.task_writer`): where Redis lost the mark (a restart without persistence, a flush, an eviction)
  while the request waited or ran, the worker holding it writes it back at its next heartbeat, before its
  submit marker (:mod:`workers.held_requests`), and the worker's result store writes it with the result, in the
  same step, so its result is never another key's to read (:mod:`broker.result_backend`).
* A mark claimed for a request the submit then did not queue (refused: queue full, rate limited, a
  conflict) is released again; after a Redis failure, whether it was queued is unknown, so it is kept.

* The mark is claimed in one Redis step and the request queued in the next (:mod:`producer.idempotent_queue`).
  A ``FleetClient`` (no key) that queues the same caller-given ID with the same body between the two makes the
  queue step find the ID known (the same request: not queued again); the marks this call claimed travel with it
  (:func:`producer.task_writer.owners_in_messages`), and the queue step deletes such a mark, in the same Redis
  step, where the submit marker does not say an owner's call queued the ID (``"owned": true``), so the client's
  request stays every key's (before, the mark stayed: the request was that key's alone). A call of the same key
  that queued the ID in between wrote ``owned``: its mark stays.

Readers compare marks with :func:`gateway.auth.same_owner` (constant time) before reading the request's
result, and answer another key's request with the 404 of an unknown ID; one that found no mark compares again
after its read (:meth:`RequestOwners.mark_of`: another key may have queued the ID in between; before, a long-poll
of an ID another key submitted meanwhile answered that key's result). While auth is off every caller is
:data:`gateway.auth.OPEN_OWNER` and nothing is written or read here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress

import redis
import redis.asyncio

from gateway.auth import OPEN_OWNER, owner_of, same_owner
from producer.admission import rate_key_for
from producer.bulk_submit import REDIS_FAILURES
from producer.idempotent_queue import conflict
from producer.task_writer import owners_in_messages
from protocol.errors import IdempotencyConflict
from protocol.keys import OWNER_KEY, REQUEST_KEY, RESULT_KEY

__all__ = ["CLAIM_OWNERS_LUA", "FOREIGN", "KNOWN_UNOWNED", "OWN", "RELEASE_OWNERS_LUA", "UNMARKED", "RequestOwners",
           "carried", "foreign", "taken"]

OWN, UNMARKED, FOREIGN = "own", "unmarked", "foreign"
"""What a mark says to a reader (:meth:`RequestOwners.mark_of`)."""

KNOWN_UNOWNED = "-"
""":data:`CLAIM_OWNERS_LUA`'s answer for an ID known without a mark (left so); ``""`` means claimed now."""

CLAIM_OWNERS_LUA = """
-- KEYS: n owner marks, n submit markers, n result keys; ARGV: ttl_s, then n owners
-- per ID: '' (claimed now), '-' (known without a mark: left so), or the owner its mark names
local n = #KEYS / 3
local out = {}
for i = 1, n do
  local stored = redis.call('GET', KEYS[i])
  if stored then
    out[i] = stored
  elseif redis.call('EXISTS', KEYS[n + i], KEYS[2 * n + i]) > 0 then
    out[i] = '-'
  else
    redis.call('SET', KEYS[i], ARGV[1 + i], 'EX', ARGV[1])
    out[i] = ''
  end
end
return out
"""

RELEASE_OWNERS_LUA = """
-- KEYS: owner marks; ARGV: the owner each must still name to be deleted
local deleted = 0
for i = 1, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[i] then deleted = deleted + redis.call('DEL', KEYS[i]) end
end
return deleted
"""


def taken(request_id: str, label: str = "") -> IdempotencyConflict:
    """The 409 for a caller-given ``request_id`` another API key's request holds: the same words whether or not
    the bodies match, so the answer tells nothing of the other key's request but that the ID is in use."""
    field = conflict(request_id, label).field  # placed in a call of many as a body conflict is
    where = f"{label}: " if label else ""
    why = "an idempotency key names one request of one API key: choose another ID"
    return IdempotencyConflict(f"{where}request_id {request_id!r} is already known; nothing was queued ({why})", field)


def carried(ids: Sequence[str], owners: Sequence[str]) -> dict[str, str]:
    """Request ID -> owner for the task messages of ``ids`` (:func:`producer.task_writer.owners_in_messages`):
    none for :data:`OPEN_OWNER` (auth off)."""
    return {rid: owner for rid, owner in zip(ids, owners, strict=True) if owner != OPEN_OWNER}


def foreign(stored: bytes | None, owner: str) -> bool:
    """Whether the mark ``stored`` (None: none) names an owner other than ``owner`` (constant time)."""
    return stored is not None and not same_owner(stored.decode(errors="replace"), owner)


def _said(stored: bytes | None, owner: str) -> str:
    """:meth:`RequestOwners.mark_of`'s answer for the mark ``stored`` (None: none)."""
    return UNMARKED if stored is None else FOREIGN if foreign(stored, owner) else OWN


class RequestOwners:
    """The gateway's reads and writes of request owner marks (see the module docstring)."""

    def __init__(self, client: redis.Redis[bytes], keys: Sequence[bytes], result_ttl_s: int) -> None:
        """``keys``: the configured API keys, encoded (empty: auth off, no marks); ``result_ttl_s``: a mark's
        time to live (s) until the worker stores the request's result."""
        self.redis = client
        self.result_ttl_s = result_ttl_s
        self._owners = {rate_key_for(k.decode()): owner_of(k.decode(), keys) for k in keys}
        self._claim = client.register_script(CLAIM_OWNERS_LUA)
        self._release = client.register_script(RELEASE_OWNERS_LUA)

    def owner_for(self, rate_key: str | None) -> str:
        """The owner of a caller whose rate bucket (:func:`producer.admission.rate_key_for`) is ``rate_key``:
        :data:`OPEN_OWNER` while auth is off. An accepted caller's key is a configured one, so its bucket is
        known; an unknown bucket owns nothing (a KeyError: a bug, never a silent open owner)."""
        return self._owners[rate_key or ""] if self._owners else OPEN_OWNER

    def claim(
        self, ids: Sequence[str], owners: Sequence[str], label: Callable[[int], str] = lambda _: ""
    ) -> list[int]:
        """Claim the marks of ``ids`` (``owners[i]`` for ``ids[i]``) in one Redis step, all or none; the positions
        claimed now (to :meth:`release` if the submit does not queue them). :data:`OPEN_OWNER` claims nothing.

        Raises:
            IdempotencyConflict: an ID's mark names another owner (:func:`taken`, named by ``label(i)``); the
                marks this call claimed are released, nothing else was written.
            redis.RedisError: Redis failed (nothing is queued after it).
        """
        claimed, foreign_at = self.claim_each(ids, owners)
        if foreign_at:
            self.release(ids, owners, claimed)
            raise taken(ids[foreign_at[0]], label(foreign_at[0]))
        return claimed

    def claim_each(self, ids: Sequence[str], owners: Sequence[str]) -> tuple[list[int], list[int]]:
        """:meth:`claim` without the refusal: (the positions claimed now, those another owner's mark holds).

        Raises:
            redis.RedisError: Redis failed.
        """
        marked = [i for i, owner in enumerate(owners) if owner != OPEN_OWNER]
        if not marked:
            return [], []
        keys = [OWNER_KEY.format(id=ids[i]) for i in marked]
        keys += [REQUEST_KEY.format(id=ids[i]) for i in marked]
        keys += [RESULT_KEY.format(id=ids[i]) for i in marked]
        found = self._claim(keys=keys, args=[self.result_ttl_s, *(owners[i] for i in marked)])
        claimed = [i for i, stored in zip(marked, found, strict=True) if stored == b""]
        held = [i for i, stored in zip(marked, found, strict=True)
                if stored not in (b"", KNOWN_UNOWNED.encode()) and foreign(stored, owners[i])]  # fmt: skip
        return claimed, held

    @contextmanager
    def claimed(
        self, ids: Sequence[str], owners: Sequence[str], label: Callable[[int], str] = lambda _: ""
    ) -> Iterator[None]:
        """:meth:`claim` the marks, run the block that queues the requests, and :meth:`release` the marks claimed
        here when it raises anything but a Redis failure (then, queued or not is unknown: they are kept). The task
        messages the block writes carry the owners (:func:`carried`), so a worker writes back a mark Redis lost.

        Raises:
            IdempotencyConflict: as :meth:`claim`; the block does not run.
        """
        claimed = self.claim(ids, owners, label)
        try:
            with owners_in_messages(carried(ids, owners), [ids[i] for i in claimed]):
                yield
        except REDIS_FAILURES:
            raise
        except BaseException:
            self.release(ids, owners, claimed)
            raise

    def release(self, ids: Sequence[str], owners: Sequence[str], positions: Iterable[int]) -> None:
        """Delete the marks at ``positions`` that still name their owner (best effort: a Redis failure leaves
        them to expire, which only keeps another key from that unqueued ID for ``result_ttl_s``)."""
        chosen = list(dict.fromkeys(positions))
        if not chosen:
            return
        with suppress(*REDIS_FAILURES):
            self._release(keys=[OWNER_KEY.format(id=ids[i]) for i in chosen], args=[owners[i] for i in chosen])

    def readable(self, request_id: str, owner: str) -> bool:
        """Whether ``owner`` may see ``request_id``: it has no mark, or its mark names ``owner``.

        Raises:
            redis.RedisError: Redis did not answer.
        """
        return self.mark_of(request_id, owner) != FOREIGN

    def mark_of(self, request_id: str, owner: str) -> str:
        """What ``request_id``'s mark says to ``owner``: :data:`OWN` (its mark, or auth off: settled, no other key's
        request can take the ID now), :data:`UNMARKED` or :data:`FOREIGN`.

        An unmarked ID may become another key's request a moment later (its mark is claimed, then it is queued): a
        reader that found it unmarked and then finds the request asks again once it has read it (the mark is
        written before the request is known, so the second answer is the request's).

        Raises:
            redis.RedisError: Redis did not answer.
        """
        return OWN if owner == OPEN_OWNER else _said(self.redis.get(OWNER_KEY.format(id=request_id)), owner)

    async def amark_of(self, aredis: redis.asyncio.Redis[bytes], request_id: str, owner: str) -> str:
        """:meth:`mark_of` on the event loop."""
        return OWN if owner == OPEN_OWNER else _said(await aredis.get(OWNER_KEY.format(id=request_id)), owner)

    def keep_with_result(self, request_id: str, owner: str) -> None:
        """Give ``request_id``'s mark the result time to live again, from now (a result the gateway itself
        stored: a cancel's). Nothing for :data:`OPEN_OWNER` or an ID without a mark."""
        if owner != OPEN_OWNER:
            self.redis.expire(OWNER_KEY.format(id=request_id), self.result_ttl_s)
