"""Taking messages off the queue and recording them as unacked in one atomic Redis step.

kombu's Redis transport takes a message with ``BRPOP`` and records it as unacked (``ZADD`` + ``HSET``)
in the next round trip: between the two the message is in neither the queue nor the unacked hash,
only in the worker's socket, and a worker SIGKILLed then loses it for good (no visibility timeout can
bring back what no key holds). The batched take (:mod:`broker.batch_take`) widened that window to
``RPOP <list> n`` and the guard's checks of n messages.

:class:`broker.poison.GuardedChannel` takes instead, when Redis allows it:

1. **a blocking wait that pops nothing**: ``BLMOVE <list> <list> RIGHT RIGHT <timeout>`` moves a
   list's oldest message to where it was (Redis does it in one command, no client sees a change) and
   returns as soon as the list holds one. Redis has no blocking wait on several lists that leaves
   them unchanged, so it waits on one list: the one the last take came from while takes keep finding
   messages (it is most likely backed up still), else the queue the worker shares with the other
   workers of its model (the channel's ``shared_queue``; without one, the first list of kombu's
   order). It waits at most :data:`OTHER_LISTS_WAIT_S` (the channel's ``other_lists_wait_s``: a
   worker with a queue of its own, :mod:`workers.direct_queue`, looks every ``routing.direct_wait_ms``)
   when the worker consumes other lists too (its canary queue, kombu's priority lists): a message
   there waits that long on an idle worker. Going back to the shared queue once the lists are empty
   is what spreads a light load over a model's workers: every idle worker waits on the list the
   requests arrive on, and Redis wakes the one that has waited longest first. A worker that kept
   waiting on its own queue saw the shared one only between waits, when the worker blocked on it had
   already taken each request (two idle workers, 40 requests one at a time: 40 to one, 0 to the other);
2. (after a wait that timed out, only when ``LLEN`` finds another list non-empty)
   **one script** (:data:`TAKE_SCRIPT`) that reads, list after list in kombu's order, the oldest
   messages of each non-empty one until it has as many as the worker has free tokens, records each as
   kombu records a delivery (``ZADD`` of its tag to ``unacked_index``, ``HSET`` of ``[message,
   "", queue]`` to ``unacked``: restored onto the queue it was taken from, whatever the routing its
   envelope names), reads its cancel mark (``EXISTS fleet:cancel:<id>``; none: it writes the request's
   taken note, :mod:`protocol.cancel_marks`), and
   only then trims them off their list. Redis runs a script whole or not at all, so every message is at
   every instant in its queue or in the unacked hash, and kombu's visibility-timeout restore brings
   back whatever a dead worker held. Taking from every list at once matters when a burst is split
   between lists (prefix-aware routing sends part of it to the worker's own queue, the rest to the
   model's): taken one list per turn, the next turn's wait would sit on the emptied list for up to
   ``other_lists_wait_s`` while the other list holds the rest of the burst.

Then each message goes through the guard's checks (a refused one is dead-lettered, and its unacked
entry removed after) and is delivered. A lone request costs one round trip after the wait, as before.

What the script cannot record is an item that is not a kombu envelope with a string
``properties.delivery_tag`` (poison, which the guard dead-letters anyway): it is taken unrecorded and
dead-lettered in the next round trip, so a kill in between drops that item (never a request the
guard would accept: every such one has a tag). Redis refusing ``BLMOVE`` or the script (before 6.2,
an ACL) turns this off for the channel with a warning, and the worker takes with ``BRPOP`` as kombu
does (:mod:`broker.batch_take`); so does a ``global_keyprefix``, which kombu's client would not apply
to the script's keys.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis
from kombu.transport import redis as kombu_redis
from kombu.utils.encoding import bytes_to_str

from broker.batch_take import RETAG, Taken, room_for_more, taken_note_life_s
from broker.cancel_marks import CancelReadingQoS
from broker.in_hand import IN_HAND, Take
from broker.redis_refusals import RedisRefusingWrites, is_write_refusal
from broker.store_ack import StoreAckingQoS
from protocol.keys import CANCEL_KEY, TAKEN_KEY

__all__ = ["OTHER_LISTS_WAIT_S", "RETAG", "TAKEN_PREFIX", "TAKE_SCRIPT", "TAKE_TRANSPORT_OPTIONS", "sections",
           "start_peek", "take_after_peek"]

log = logging.getLogger("fleet.poison")

OTHER_LISTS_WAIT_S = 0.25
"""Longest blocking wait, in seconds, when the worker consumes more than one list: a message on a list
other than the one waited on is seen at the wait's end, so at most this late on an idle worker."""

TAKE_TRANSPORT_OPTIONS = ("other_lists_wait_s", "shared_queue")
"""The channel's transport options this module reads, beside kombu's own."""

if not CANCEL_KEY.endswith("{id}"):  # the script builds the key as prefix .. task id
    raise ImportError(f"CANCEL_KEY must end with its task ID: {CANCEL_KEY!r}")
CANCEL_PREFIX = CANCEL_KEY.format(id="")
if not TAKEN_KEY.endswith("{id}"):
    raise ImportError(f"TAKEN_KEY must end with its task ID: {TAKEN_KEY!r}")
TAKEN_PREFIX = TAKEN_KEY.format(id="")

TAKE_SCRIPT = """
local lists = #KEYS - 2
local hash, index = KEYS[lists + 1], KEYS[lists + 2]
local most, now, mark_prefix = tonumber(ARGV[1]), ARGV[2], ARGV[3]
local taken_prefix, taken_ttl = ARGV[4], ARGV[5]
for i = 6, #ARGV do  -- deliveries whose result store is under way: a token each, once their entry is gone
  if redis.call('HEXISTS', hash, ARGV[i]) == 0 then most = most + 1 end
end

local function refused(reply) return type(reply) == 'table' and reply.err end

-- one list's oldest messages (up to room), recorded then trimmed: {list, error or false, count, rows...}
local RETAG = ARGV_RETAG  -- the Python constant RETAG, as a Lua string
local function take(key, room)
  local items = redis.call('LRANGE', key, -room, -1)
  -- restored (worker gone) onto the queue it was taken from, whatever its envelope's routing says
  local restore_to = cjson.encode(string.match(key, '^(.-)\\6\\22') or key)
  local out = {key, false, 0}
  local recorded = {}
  for j = #items, 1, -1 do
    local raw = items[j]
    local tag, task_id, mark = false, false, false
    local ok, message = pcall(cjson.decode, raw)
    local props = ok and type(message) == 'table' and message.properties
    if type(props) == 'table' and type(props.delivery_tag) == 'string' and props.delivery_tag ~= '' then
      local entry = '[' .. raw .. ',"",' .. restore_to .. ']'
      tag = props.delivery_tag
      if redis.call('HEXISTS', hash, tag) == 1 then  -- another message holds the tag: this one gets its own
        local clock = redis.call('TIME')
        tag = tag .. RETAG .. clock[1] .. clock[2] .. '.' .. j
      end
      local reply = redis.pcall('ZADD', index, now, tag)
      if not refused(reply) then reply = redis.pcall('HSET', hash, tag, entry) end
      if refused(reply) then
        out[2] = reply.err
        break
      end
      recorded[#recorded + 1] = tag
      local headers = message.headers
      if type(headers) == 'table' and type(headers.id) == 'string' and headers.id ~= '' then
        task_id = headers.id
        mark = redis.call('EXISTS', mark_prefix .. task_id)
        if mark == 0 then  -- a cancel from now on is asked of this worker (protocol.cancel_marks)
          redis.pcall('SET', taken_prefix .. task_id, '1', 'EX', taken_ttl)
        end
      end
    end
    out[#out + 1] = raw
    out[#out + 1] = tag
    out[#out + 1] = task_id
    out[#out + 1] = mark
  end
  local taken = (#out - 3) / 4
  out[3] = taken
  if taken > 0 then
    local reply = redis.pcall('LTRIM', key, 0, -taken - 1)
    if refused(reply) then
      for _, t in ipairs(recorded) do
        redis.pcall('HDEL', hash, t)
        redis.pcall('ZREM', index, t)
      end
      return {key, reply.err, 0}
    end
  end
  return out
end

local reply = {}
for i = 1, lists do
  if most <= 0 then break end
  if redis.call('LLEN', KEYS[i]) > 0 then
    local section = take(KEYS[i], most)
    for _, v in ipairs(section) do reply[#reply + 1] = v end
    most = most - section[3]
    if section[2] then break end
  end
end
if #reply == 0 then return false end
return reply
""".replace("ARGV_RETAG", repr(RETAG))
"""KEYS: the lists in kombu's order, then kombu's unacked hash and its index. ARGV: the most messages to
take (over all lists), now (Unix s, the index's score, as kombu writes it), the cancel mark keys' prefix,
the taken notes' prefix and life (s; a note is written for each request taken without a cancel mark,
:mod:`protocol.cancel_marks`), then the tags of this worker's deliveries whose result is being stored: one
more message for each whose unacked entry the store script has already removed (its result is written; the
storing thread has not noted it yet, and the caller may already have queued more).

Takes from each non-empty list in order until ``most`` are taken. Returns false when every list is
empty, else one section per list it took from (or was refused on): ``list, error or nil, n`` then ``n``
rows of ``message, tag, task ID, cancel mark``, oldest first (the tag it was recorded under: its own,
or its own + :data:`RETAG` + a suffix when another unacked message holds that tag); tag nil = not
recorded, task ID/mark nil = mark not read. A write Redis refuses stops the take there (``error``, the
last section): what was recorded is taken, the rest stays queued."""


def sections(reply: list[Any]) -> list[tuple[str, Any, list[Any]]]:
    """The take script's reply as ``(list, error or None, rows)`` per list, in the order taken."""
    out: list[tuple[str, Any, list[Any]]] = []
    k = 0
    while k + 3 <= len(reply):
        count = int(reply[k + 2])
        out.append((bytes_to_str(reply[k]), reply[k + 1], reply[k + 3 : k + 3 + 4 * count]))  # type: ignore[no-untyped-call]
        k += 3 + 4 * count
    return out


def start_peek(channel: Any, timeout: float | None = None) -> bool:
    """Send the blocking wait on ``channel``'s ``BRPOP`` connection, in kombu's ``_brpop_start``'s place.

    Returns False when the channel takes with ``BRPOP`` instead (atomic take off, a QoS that records
    deliveries itself, a ``global_keyprefix``)."""
    if not channel.take_atomic or channel.global_keyprefix or not isinstance(channel.qos, CancelReadingQoS):
        return False
    queues = channel._queue_cycle.consume(len(channel.active_queues))
    if not queues:
        return True
    keys = [channel._q_for_pri(queue, pri) for pri in channel.priority_steps for queue in queues]
    wait_s = float(channel.brpop_timeout if timeout is None else timeout)
    if len(keys) > 1:
        other_s = float(getattr(channel, "other_lists_wait_s", OTHER_LISTS_WAIT_S))
        wait_s = min(wait_s, other_s) if wait_s > 0 else other_s
    waited_on = _list_to_wait_on(channel, keys)
    channel.take_keys = tuple(keys)
    channel.take_waited_on = waited_on
    channel.peek_sent = True
    channel._in_poll = channel.client.connection
    channel._brpop_sent_at = time.monotonic()
    channel.client.connection.send_command("BLMOVE", waited_on, waited_on, "RIGHT", "RIGHT", wait_s)
    return True


def _list_to_wait_on(channel: Any, keys: list[str]) -> str:
    """The list the blocking wait sits on: the last take's while takes keep finding messages (most likely
    still backed up: the wait returns at once), else the shared queue's first list, else kombu's first."""
    last = getattr(channel, "take_last_list", None)
    if last in keys:
        return str(last)
    shared = getattr(channel, "shared_queue", None)
    home = channel._q_for_pri(shared, channel.priority_steps[0]) if shared else None
    return str(home) if home in keys else keys[0]


def take_after_peek(channel: Any, **options: Any) -> bool:
    """Read the wait's reply, take and record messages in one script run, check and deliver them.

    Raises kombu's ``Empty`` when no list held a message (another worker took it, or the wait timed out).
    """
    channel.peek_sent = False
    client = channel.client
    try:
        peeked = client.parse_response(client.connection, "BLMOVE", **options)
    except channel.connection_errors:
        client.connection.disconnect()
        raise
    except redis.exceptions.ResponseError as exc:
        client.connection.disconnect()
        if is_write_refusal(exc):  # Celery reconnects, with backoff, until Redis takes writes
            raise RedisRefusingWrites(f"Redis refused BLMOVE: {exc}") from exc
        _turn_off(channel, "BLMOVE", exc)
        raise kombu_redis.Empty() from exc  # type: ignore[attr-defined]
    if getattr(channel, "_closing", False):  # kombu reads a pending reply at close; the wait popped nothing
        raise kombu_redis.Empty()  # type: ignore[attr-defined]
    if peeked is None and not _others_hold_messages(channel):  # the wait timed out on an idle worker
        channel.take_last_list = None  # nothing backed up: the next wait goes back to the shared queue
        raise kombu_redis.Empty()  # type: ignore[attr-defined]
    with IN_HAND.taking() as take:  # from the script's run in Redis until its messages are counted
        reply = _run_script(channel)
        taken = sections(reply) if reply else []
        if not taken or not _deliver_sections(channel, taken, take):
            channel.take_last_list = None  # another worker took them first
            raise kombu_redis.Empty()  # type: ignore[attr-defined]
    return True


def _deliver_sections(channel: Any, taken: list[tuple[str, Any, list[Any]]], take: Take) -> bool:
    """Check and deliver each list's messages of one take, in order; False when none was taken.
    ``take``: the take in flight, which counts them as in hand (:mod:`broker.in_hand`).

    Raises RedisRefusingWrites when Redis refused to record the first list's messages (nothing taken);
    any other refusal there turns the atomic take off (an ACL without ZADD, HSET or LTRIM)."""
    left = [sum(len(rows) // 4 for _, _, rows in taken)]  # in hand until each is handed to Celery
    take.took(left[0])
    try:
        return _deliver_in_order(channel, taken, left)
    finally:
        IN_HAND.handing(left[0])


def _deliver_in_order(channel: Any, taken: list[tuple[str, Any, list[Any]]], left: list[int]) -> bool:
    """:func:`_deliver_sections`' work, with ``left`` the take's messages still in hand."""
    delivered = False
    for list_key, error, rows in taken:
        refusal = redis.exceptions.ResponseError(bytes_to_str(error)) if error else None  # type: ignore[no-untyped-call]
        if refusal is not None and not rows and not delivered:  # nothing was taken
            if is_write_refusal(refusal):
                raise RedisRefusingWrites(f"Redis refused to record messages from {list_key}: {refusal}")
            _turn_off(channel, "a command of the take script", refusal)
            return False
        if refusal is not None:
            log.warning("Redis refused to record more messages from %s: %s", list_key, refusal)
        if rows:
            queue = list_key.rsplit(channel.sep, 1)[0]
            channel._queue_cycle.rotate(queue)
            channel.take_last_list = list_key
            _check_and_deliver(channel, queue, list_key, rows, left)
            delivered = True
    return delivered


def _others_hold_messages(channel: Any) -> bool:
    """Whether a list other than the one waited on holds a message (one ``LLEN`` each, one round trip):
    an idle worker's timed-out wait costs that, not a run of the take script."""
    others = [key for key in channel.take_keys if key != getattr(channel, "take_waited_on", None)]
    if not others:
        return False
    with channel.conn_or_acquire() as client:
        pipe = client.pipeline(transaction=False)
        for key in others:
            pipe.llen(key)
        return any(int(n or 0) for n in pipe.execute())


def _run_script(channel: Any) -> Any:
    qos = channel.qos
    most = 1 + room_for_more(qos) if channel.take_batch else 1
    storing = qos.acks.storing_among(qos._delivered) if channel.take_batch and isinstance(qos, StoreAckingQoS) else []
    keys = [*channel.take_keys, qos.unacked_key, qos.unacked_index_key]
    try:
        with channel.conn_or_acquire() as sync:
            script = channel.take_script
            if script is None or script.registered_client is not sync:
                script = channel.take_script = sync.register_script(TAKE_SCRIPT)
            args = [most, repr(time.time()), CANCEL_PREFIX, TAKEN_PREFIX, taken_note_life_s(channel), *storing]
            return script(keys=keys, args=args, client=sync)
    except redis.exceptions.ResponseError as exc:
        if is_write_refusal(exc):
            raise RedisRefusingWrites(f"Redis refused the take: {exc}") from exc
        _turn_off(channel, "the take script", exc)
        raise kombu_redis.Empty() from exc  # type: ignore[attr-defined]


def _refused_one(left: list[int]) -> None:
    """One taken message leaves the worker's hand: the checks refused it."""
    left[0] -= 1
    IN_HAND.handing()


def _hand_over(channel: Any, queue: str, list_key: str, taken: Taken, left: list[int]) -> None:
    """Deliver one checked message; it counts as on its way, by task ID, until Celery's call returns
    (Celery reserves it inside the call, and may start its task before the call returns)."""
    left[0] -= 1
    with IN_HAND.handing_over(taken.task_id):
        channel._deliver_checked(queue, list_key, taken)


def _check_and_deliver(channel: Any, queue: str, list_key: str, rows: list[Any], left: list[int]) -> None:
    """The guard's checks on each taken message (refused: dead-lettered), then delivery in order; the
    unacked entries of refused messages are removed once their dead letters are written. ``left``: how
    many of the take are still in hand (:data:`broker.in_hand.IN_HAND`), one less per message handed."""
    accepted: list[Taken] = []
    stray: list[str] = []
    for k in range(0, len(rows) - 3, 4):
        raw, tag, task_id, mark = rows[k : k + 4]
        recorded = bytes_to_str(tag) if tag else None  # type: ignore[no-untyped-call]
        taken = channel._check(queue, list_key, raw if isinstance(raw, bytes) else str(raw).encode())
        if taken is None:
            _refused_one(left)
            if recorded:
                stray.append(recorded)
            continue
        if recorded is not None and recorded.startswith(taken.tag + RETAG):  # the sender's tag was held already
            taken = taken.retagged(recorded)
        if recorded == taken.tag:
            read_for = bytes_to_str(task_id) if task_id else None  # type: ignore[no-untyped-call]
            channel.pre_taken[taken.tag] = bool(mark) if read_for and read_for == taken.task_id else None
        elif recorded:  # read another way than kombu reads it: kombu's own bookkeeping records it
            stray.append(recorded)
        accepted.append(taken)
    delivered = 0
    try:
        for taken in accepted:
            _hand_over(channel, queue, list_key, taken, left)
            delivered += 1
    finally:
        for taken in accepted[delivered:]:  # recorded as unacked: restored after the visibility timeout
            channel.pre_taken.pop(taken.tag, None)
        if stray:
            _forget(channel, stray)


def _forget(channel: Any, tags: list[str]) -> None:
    """Remove unacked entries the take script wrote for messages the guard refused (hash entry first,
    as kombu's ack does)."""
    qos = channel.qos
    try:
        with channel.conn_or_acquire() as client:
            pipe = client.pipeline(transaction=False)
            for tag in tags:
                pipe.hdel(qos.unacked_key, tag)
                pipe.zrem(qos.unacked_index_key, tag)
            pipe.execute()
    except Exception:  # left behind, they come back after the visibility timeout and are refused again
        log.exception("could not remove the unacked entries of %d refused messages", len(tags))


def _turn_off(channel: Any, what: str, exc: BaseException) -> None:
    channel.take_atomic = False
    log.warning("Redis refused %s (%s): taking with BRPOP, which a worker killed between the pop and its "
                "bookkeeping can lose messages to", what, exc)
