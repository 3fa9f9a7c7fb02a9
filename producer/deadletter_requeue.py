"""One copy per request ID: what a dead-letter requeue may put back, and the Redis step that puts it back.

A request ID is what runs: a ``fleet.infer`` message carries one (its task ID), a ``fleet.infer_bulk``
message many (its requests') under a task ID of its own, and two dead-lettered messages (two bulks, or a bulk
and a single) can carry the same request ID under different task IDs. So a requeue claims every ID it puts
back (:data:`protocol.deadletter.REQUEUED_KEY`, per request ID), and :func:`plan_bulk` drops from a bulk
message the requests it must not run again: those another requeue put back that have no outcome yet, and
those with an outcome stored that their dead-lettering did not store (a copy ran; the result store never
replaces it). The message put back carries the others (:func:`broker.bulk_item_without`); a bulk message whose
every request is dropped is refused, naming them. Entries whose every request ID the requeue put back (the same
task ID, or a bulk's requests all covered) are marked ``superseded_by`` it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, NamedTuple

from broker import bulk_request_ids
from protocol.deadletter import DEAD_LETTERED, REQUEUED_KEY, DeadLetter
from protocol.keys import RESULT_KEY

__all__ = ["REQUEUE_SCRIPT", "BulkPlan", "carried_ids", "outcome_of", "plan_bulk"]

_DONE = ("SUCCESS", "FAILURE", "REVOKED")

# Take the entry off the dead-letter list and put its item back on its queue in one step: two operators
# requeueing the same entry push it once, and a crash in between loses nothing. The FAILURE the dead-lettering
# stored (under each ID put back) goes in the same step, before the message is back: a worker may take it at
# once and store its outcome, which the result store never replaces. Any other stored outcome is kept.
# IDs put back come in two kinds. The lead ID (ARGV[6] = '1': the task ID, first): when it and every other ID
# have an outcome kept, nothing is done ({2}); while its claim stands and it has no outcome, its copy is still
# out ({3, the claim}). The planned IDs (a bulk message's requests, checked free by plan_bulk): one that has
# since been claimed by another requeue or got an outcome kept returns {4, its position}: plan again.
# Otherwise every ID put back is claimed, and the entries of ARGV pairs (as read, as marked) are marked.
# KEYS: the dead-letter list, the queue, the delivery count, then (result, claim) per ID; ARGV: the entry, the
# message, DEAD_LETTERED, the claim's value, its TTL in s, the lead flag, then the (read, marked) pairs.
# Returns {0} (no such entry), {1, FAILUREs cleared, outcomes kept, entries marked}, {2, kept, status}, {3, 0,
# 0, claim} or {4, 0, 0, position of the planned ID (1 = the first ID)}.
REQUEUE_SCRIPT = """
if not redis.call('LPOS', KEYS[1], ARGV[1]) then return {0, 0, 0, ''} end
local n = (#KEYS - 3) / 2
local ours, kept, status_kept = {}, 0, ''
for j = 1, n do
  local result, claim_key = KEYS[2 + 2 * j], KEYS[3 + 2 * j]
  local lead = j == 1 and ARGV[6] == '1'
  local ok, meta = pcall(cjson.decode, redis.call('GET', result) or '')
  local status = ok and type(meta) == 'table' and meta['status']
  if status == 'SUCCESS' or status == 'FAILURE' or status == 'REVOKED' then
    local exc = status == 'FAILURE' and meta['result']
    local why = type(exc) == 'table' and type(exc['exc_message']) == 'table' and exc['exc_message'][1]
    if type(why) == 'string' and string.sub(why, 1, #ARGV[3]) == ARGV[3] then
      ours[#ours + 1] = result
    elseif lead then
      kept = kept + 1
      status_kept = status
    else
      return {4, 0, 0, j}
    end
  else
    local claim = redis.call('GET', claim_key)
    if claim and lead then return {3, 0, 0, claim} end
    if claim then return {4, 0, 0, j} end
  end
end
if n > 0 and kept == n then return {2, kept, status_kept, ''} end
redis.call('LREM', KEYS[1], 1, ARGV[1])
local marked = 0
for i = 7, #ARGV - 1, 2 do
  local at = redis.call('LPOS', KEYS[1], ARGV[i])
  if at then
    redis.call('LSET', KEYS[1], at, ARGV[i + 1])
    marked = marked + 1
  end
end
for _, key in ipairs(ours) do redis.call('DEL', key) end
redis.call('DEL', KEYS[3])
for j = 1, n do redis.call('SET', KEYS[3 + 2 * j], ARGV[4], 'EX', ARGV[5]) end
redis.call('LPUSH', KEYS[2], ARGV[2])
return {1, #ours, kept, marked}
"""


def outcome_of(raw_result: bytes | None) -> tuple[str | None, bool]:
    """(the stored outcome's status, None when there is none; whether a dead-lettering stored it), as the
    script above reads a result key's value."""
    try:
        meta = json.loads(raw_result) if raw_result is not None else None
    except ValueError:
        return None, False
    if not isinstance(meta, dict) or meta.get("status") not in _DONE:
        return None, False
    status = meta["status"]
    exc = meta.get("result") if status == "FAILURE" else None
    why = exc.get("exc_message") if isinstance(exc, dict) else None
    ours = isinstance(why, list) and bool(why) and isinstance(why[0], str) and why[0].startswith(DEAD_LETTERED)
    return str(status), ours


class BulkPlan(NamedTuple):
    """What a requeue of a bulk entry puts back: request IDs kept in the message, and those dropped with why."""

    put_back: list[str]
    out: dict[str, str]
    """Dropped: put back by another requeue and no outcome yet (ID → that requeue's claim, JSON)."""
    done: dict[str, str]
    """Dropped: an outcome stored that its dead-lettering did not store (ID → its status)."""


def plan_bulk(client: Any, request_ids: Sequence[str]) -> BulkPlan:
    """Which of a bulk entry's ``request_ids`` go back (one round trip: each ID's result and claim)."""
    pipe = client.pipeline(transaction=False)
    for rid in request_ids:
        pipe.get(RESULT_KEY.format(id=rid))
        pipe.get(REQUEUED_KEY.format(id=rid))
    read = pipe.execute()
    put_back: list[str] = []
    out: dict[str, str] = {}
    done: dict[str, str] = {}
    for i, rid in enumerate(request_ids):
        status, ours = outcome_of(read[2 * i])
        claim = read[2 * i + 1]
        if status is not None and not ours:
            done[rid] = status
        elif status is None and claim is not None:
            out[rid] = claim.decode(errors="replace") if isinstance(claim, bytes) else str(claim)
        else:
            put_back.append(rid)
    return BulkPlan(put_back, out, done)


def carried_ids(entry: DeadLetter) -> set[str]:
    """The request IDs ``entry``'s message would run: a bulk message's requests', else its task ID."""
    ids = set(bulk_request_ids(entry.raw_bytes()))
    if not ids and entry.task_id:
        ids.add(entry.task_id)
    return ids
