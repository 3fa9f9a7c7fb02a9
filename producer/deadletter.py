"""The dead-letter list from the operator's side: read, requeue, purge (``fleet dead-letter``).

Entries are :class:`protocol.deadletter.DeadLetter` JSON items on the Redis list
``fleet:dead-letter``, newest first; workers only ever push to it. Here entries are found by
their own ID or by the task ID they carry, and removed by value (``LREM``), so a worker pushing
meanwhile never disturbs an operation.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Any

from broker import bulk_request_ids, item_eta_too_far
from protocol.deadletter import DEAD_LETTERED, UNKNOWN_QUEUE, DeadLetter, Reason, read_entry, requeue_allowed
from protocol.errors import InvalidRequest, RequestNotFound
from protocol.keys import DEAD_LETTER_KEY, DELIVERIES_KEY, RESULT_KEY
from protocol.settings import shared_queue_of

__all__ = ["DeadLetterStore", "fresh_delivery", "requeue_refusal"]

# Take the entry off the dead-letter list and put its item back on its queue in one step: two
# operators requeueing the same entry push it once, and a crash in between loses nothing.
# The FAILURE the dead-lettering stored (under the task's ID, and each request's of a bulk message) goes
# in the same step, before the message is back: a worker may take it at once and store its outcome, which
# the result store never replaces. Any other stored outcome (a copy that ran meanwhile) is kept, and when
# every ID the message carries has one, nothing is done: the run could store nothing (and a message that
# killed its workers would kill one more), so the entry stays and the script says which outcome it found.
# KEYS: the dead-letter list, the queue, the delivery count, then the result keys; ARGV: the entry, the
# message, DEAD_LETTERED (how a guard's FAILURE message begins).
# Returns {0} (no such entry), {1, FAILUREs cleared, outcomes kept} (requeued) or {2, outcomes kept, the
# first one's status} (nothing to requeue).
_REQUEUE = """
if not redis.call('LPOS', KEYS[1], ARGV[1]) then return {0, 0, 0} end
local ours, kept, status_kept = {}, 0, ''
for i = 4, #KEYS do
  local ok, meta = pcall(cjson.decode, redis.call('GET', KEYS[i]) or '')
  local status = ok and type(meta) == 'table' and meta['status']
  if status == 'SUCCESS' or status == 'FAILURE' or status == 'REVOKED' then
    local exc = status == 'FAILURE' and meta['result']
    local why = type(exc) == 'table' and type(exc['exc_message']) == 'table' and exc['exc_message'][1]
    if type(why) == 'string' and string.sub(why, 1, #ARGV[3]) == ARGV[3] then
      ours[#ours + 1] = KEYS[i]
    else
      kept = kept + 1
      if status_kept == '' then status_kept = status end
    end
  end
end
if #KEYS > 3 and kept == #KEYS - 3 then return {2, kept, status_kept} end
redis.call('LREM', KEYS[1], 1, ARGV[1])
for _, key in ipairs(ours) do redis.call('DEL', key) end
redis.call('DEL', KEYS[3])
redis.call('LPUSH', KEYS[2], ARGV[2])
return {1, #ours, kept}
"""


def fresh_delivery(item: bytes) -> bytes:
    """``item`` without kombu's ``redelivered`` marks, so a requeued message counts its deliveries anew.

    Anything that is not a JSON envelope with those marks comes back unchanged, byte for byte.
    """
    try:
        doc = json.loads(item)
    except ValueError:
        return item
    changed = False
    if isinstance(doc, dict):
        headers, props = doc.get("headers"), doc.get("properties")
        info = props.get("delivery_info") if isinstance(props, dict) else None
        for part in (headers, info):
            if isinstance(part, dict) and "redelivered" in part:
                del part["redelivered"]
                changed = True
    return json.dumps(doc).encode("utf-8") if changed else item


def requeue_refusal(entry: DeadLetter, *, now_unix_s: float, visibility_timeout_s: float | None) -> str | None:
    """Why a worker would refuse ``entry``'s message again were it requeued at ``now_unix_s`` (Unix s), in words;
    None when it would take it.

    An ``eta_beyond_visibility`` entry is refused again while its ETA is still further ahead than
    ``visibility_timeout_s`` allows (:func:`broker.max_eta_ahead_s`), and taken (run at its ETA, or at once
    when that has passed) from then on; without ``visibility_timeout_s`` it counts as refused. Other reasons:
    :func:`protocol.deadletter.requeue_allowed`.
    """
    why = f"entry {entry.id} was dead-lettered as {entry.reason.value} ({entry.detail})"
    if entry.reason is Reason.ETA_BEYOND_VISIBILITY and visibility_timeout_s is not None:
        too_far = item_eta_too_far(entry.raw_bytes(), now_unix_s=now_unix_s, visibility_timeout_s=visibility_timeout_s)
        if too_far is None:
            return None
        in_reach = datetime.fromtimestamp(too_far.in_reach_at_unix_s, UTC).isoformat(timespec="seconds")
        return (f"entry {entry.id} was dead-lettered as {entry.reason.value}, and its {too_far.summary()} still: a "
                f"worker would refuse it again until {in_reach}, and take it from then on (to run at its ETA)")
    return None if requeue_allowed(entry.reason, entry.task) else f"{why}; a worker would refuse it again"


class DeadLetterStore:
    """Operations on the dead-letter list of one Redis (a redis-py client returning bytes).

    ``visibility_timeout_s`` is the fleet's (:class:`protocol.settings.FleetSettings`): with it, an
    ``eta_beyond_visibility`` entry whose ETA has come within reach requeues without ``force``.
    """

    def __init__(self, client: Any, visibility_timeout_s: float | None = None) -> None:
        self.client = client
        self.visibility_timeout_s = visibility_timeout_s

    def refusal(self, entry: DeadLetter, now_unix_s: float | None = None) -> str | None:
        """:func:`requeue_refusal` for ``entry`` now (or at ``now_unix_s``), with this store's visibility timeout."""
        now = time.time() if now_unix_s is None else now_unix_s  # wall clock: an ETA is a wall-clock time
        return requeue_refusal(entry, now_unix_s=now, visibility_timeout_s=self.visibility_timeout_s)

    def entries(self) -> list[tuple[bytes, DeadLetter]]:
        """Every entry, newest first, with the list item it was read from."""
        return [(item, read_entry(item)) for item in self.client.lrange(DEAD_LETTER_KEY, 0, -1)]

    def find(self, ident: str) -> tuple[bytes, DeadLetter]:
        """The entry with ID ``ident``, else the newest entry whose task ID is ``ident``.

        Raises:
            RequestNotFound: no such entry.
        """
        entries = self.entries()
        for item, entry in entries:
            if entry.id == ident:
                return item, entry
        for item, entry in entries:
            if entry.task_id == ident:
                return item, entry
        raise RequestNotFound(f"no dead-letter entry with ID or task ID {ident!r}", "id", None)

    def requeue(self, ident: str, *, force: bool = False) -> tuple[DeadLetter, int, int]:
        """Push the entry's message back onto the list it came from (the model's queue, for a message
        taken from a worker's own queue) and remove the entry.

        Its delivery count is reset (and its ``redelivered`` marks dropped), so it gets
        ``max_deliveries`` deliveries again, and the FAILURE stored when it was dead-lettered is removed
        (its task's, and each request's of a bulk message), so it runs to a new outcome: the requeued copy's.
        Any other stored outcome is kept (the store never replaces one). Returns the entry, how many such
        FAILUREs were removed and how many other outcomes were kept.

        Raises:
            RequestNotFound: no such entry (or another operator took it first).
            InvalidRequest: a worker would refuse it again (:meth:`refusal`: a malformed message, or an ETA
                still too far ahead; ``force`` pushes it anyway); its queue is unknown (an item from before
                entries had a schema, with no routing key); or nothing to requeue: every ID it carries has an
                outcome stored already that its dead-lettering did not store (a copy that ran): it would run
                for nothing, and the entry is kept (:meth:`delete` removes it).
        """
        stored, entry = self.find(ident)
        if entry.reason is Reason.LEGACY and entry.list_key == UNKNOWN_QUEUE:
            raise InvalidRequest(f"entry {entry.id} has no queue to go back to (an item pushed before dead-letter "
                                 "entries had a schema, without a routing key): `fleet dead-letter show` it and "
                                 "send it again yourself, or delete it", "queue", UNKNOWN_QUEUE)  # fmt: skip
        refusal = None if force else self.refusal(entry)
        if refusal is not None:
            raise InvalidRequest(f"{refusal}. Use --force to requeue it anyway", "force", entry.reason.value)
        deliveries_key = DELIVERIES_KEY.format(id=entry.task_id or "")
        target = shared_queue_of(entry.list_key)  # a worker's own queue: onto the model's (that worker may be gone)
        item = entry.raw_bytes()
        ids = list(dict.fromkeys([*([entry.task_id] if entry.task_id else []), *bulk_request_ids(item)]))
        done, count, kept = self.client.eval(
            _REQUEUE, 3 + len(ids), DEAD_LETTER_KEY, target, deliveries_key, *[RESULT_KEY.format(id=i) for i in ids],
            stored, fresh_delivery(item), DEAD_LETTERED,
        )
        if done == 0:
            raise RequestNotFound(f"dead-letter entry {entry.id} was removed meanwhile", "id", None)
        if done == 2:
            status = kept.decode() if isinstance(kept, bytes) else str(kept)
            which = (f"its request {entry.task_id}" if len(ids) == 1 else f"each of the {len(ids)} requests it carries "
                     f"({entry.task_id} and those of its bulk body)")  # fmt: skip
            raise InvalidRequest(
                f"nothing to requeue: {which} already has an outcome stored ({status}) that its dead-lettering did "
                f"not store (a copy ran meanwhile); the result store never replaces it, so the message would run for "
                f"nothing. Entry {entry.id} is kept: `fleet dead-letter delete {entry.id}` removes it",
                "id", status,
            )
        return entry, int(count), int(kept)

    def delete(self, ident: str) -> DeadLetter:
        """Remove the entry with ID (or newest with task ID) ``ident``, nothing else; returns it.

        Raises:
            RequestNotFound: no such entry (or another operator removed or requeued it first).
        """
        stored, entry = self.find(ident)
        if not self.client.lrem(DEAD_LETTER_KEY, 1, stored):
            raise RequestNotFound(f"dead-letter entry {entry.id} was removed meanwhile", "id", None)
        return entry

    def purge(self, *, older_than_s: float, now_unix_s: float) -> int:
        """Remove the entries dead-lettered more than ``older_than_s`` ago; returns how many went."""
        removed = 0
        for item, entry in self.entries():
            if now_unix_s - entry.dead_lettered_at_unix_s > older_than_s:
                removed += int(self.client.lrem(DEAD_LETTER_KEY, 1, item))
        return removed

    def purge_all(self) -> int:
        """Remove every entry; returns how many there were."""
        pipe = self.client.pipeline(transaction=True)
        pipe.llen(DEAD_LETTER_KEY)
        pipe.delete(DEAD_LETTER_KEY)
        count, _ = pipe.execute()
        return int(count)

    def count(self) -> int:
        """Entries in the list now."""
        return int(self.client.llen(DEAD_LETTER_KEY))
