"""The stream publisher's one write: :data:`WRITE_SCRIPT`, its arguments, its reply, its connection.

A write of :class:`workers.stream_publisher.StreamPublisher` is one ``EVALSHA`` of :data:`WRITE_SCRIPT`:
:func:`script_arguments` packs each stream's events as entries of up to ``max_events_per_entry`` events
(:func:`protocol.streams.encode_events`) into the keys and one payload argument; :func:`refusals` reads the
reply (a passing refusal, Redis unable to write *now*, raises so that the whole chunk is written again);
:class:`ScriptConnection` runs it on a connection of the publisher's own.
"""

from __future__ import annotations

import hashlib
from typing import Any

import redis

from protocol.streams import EVENT_FIELD, REST_FIELD, encode_events
from workers.stream_buffer import HeldEvent

__all__ = ["WRITE_SCRIPT", "ScriptConnection", "bytes_to_text", "refusals", "script_arguments"]

_OUTAGE_PREFIXES = ("OOM", "MASTERDOWN", "TRYAGAIN", "BUSY", "LOADING")
"""Replies that say Redis cannot write *now*: the events are kept and written later."""
_OUTAGE_REPLIES = (*_OUTAGE_PREFIXES, "READONLY", "NOREPLICAS", "MISCONF")
"""The same, as :data:`WRITE_SCRIPT` hands back a command's error (a replica after a failover, too few
replicas, a failing snapshot are passing states as well)."""
WRITE_SCRIPT = """
local maxlen, ttl, payload = ARGV[1], ARGV[2], ARGV[3]
local out = {}
local at = 1
for i = 1, #KEYS do
  local stop = string.find(payload, '\\30', at, true) or (#payload + 1)
  local cut = string.find(payload, '\\n', at + 1, true)
  local reply
  if cut and cut < stop then
    reply = redis.pcall('XADD', KEYS[i], 'MAXLEN', '~', maxlen, '*', 'e', string.sub(payload, at + 1, cut - 1),
                        'r', string.sub(payload, cut + 1, stop - 1))
  else
    reply = redis.pcall('XADD', KEYS[i], 'MAXLEN', '~', maxlen, '*', 'e', string.sub(payload, at + 1, stop - 1))
  end
  if type(reply) == 'table' and reply.err then
    out[i] = reply.err
  else
    out[i] = 1
    if string.byte(payload, at) == 49 then redis.pcall('EXPIRE', KEYS[i], ttl) end
  end
  at = stop + 1
end
return out
"""
"""One write of the publisher: KEYS are the entries' streams (a stream twice for two entries), ARGV the
``MAXLEN ~`` cap, the TTL (s) and the entries, each as ``1`` when its stream's ``EXPIRE`` is due after it
(else ``0``), its ``e`` field and, when it has one, a newline and its ``r`` field, separated by ``\\x1e``
(JSON never holds a raw control character). Returns per entry 1, or the error Redis gave its ``XADD``.
One command with three arguments besides the keys, not a pipeline of an ``XADD`` per entry: redis-py packs
each argument and parses each reply in Python, which was most of the publisher's CPU
(``fleet bench --only streaming``)."""


def bytes_to_text(reply: bytes | str | int) -> str:
    """A script reply element as text."""
    return reply.decode(errors="replace") if isinstance(reply, bytes) else str(reply)


def script_arguments(
    by_key: dict[str, list[HeldEvent]], expiring: set[str], max_events_per_entry: int
) -> tuple[list[str], str, list[int]]:
    """The KEYS of one run of :data:`WRITE_SCRIPT`, its payload argument and the events of each entry:
    each stream's events (``by_key``, in order) as entries of up to ``max_events_per_entry``, the last
    entry of a stream in ``expiring`` marked for its ``EXPIRE``."""
    keys: list[str] = []
    entries: list[str] = []
    sizes: list[int] = []
    for key, events in by_key.items():
        for i in range(0, len(events), max_events_per_entry):
            entry = events[i : i + max_events_per_entry]
            fields = encode_events([held.event for held in entry])
            rest = f"\n{fields[REST_FIELD]}" if REST_FIELD in fields else ""
            last_entry = i + max_events_per_entry >= len(events)
            keys.append(key)
            entries.append(f"{int(last_entry and key in expiring)}{fields[EVENT_FIELD]}{rest}")
            sizes.append(len(entry))
    return keys, "\x1e".join(entries), sizes


def refusals(replies: list[Any], sizes: list[int]) -> tuple[int, str | None]:
    """The events Redis refused for good in a run of :data:`WRITE_SCRIPT` (``sizes``: the events of each
    entry), and the first error it gave (None when it refused none).

    Raises:
        redis.ResponseError: Redis cannot write now (out of memory, a replica, loading, …): the whole
            chunk is to be written again (a reader drops the entries it already has, by index).
    """
    errors = [bytes_to_text(r) for r in replies if r != 1]
    passing = next((e for e in errors if e.startswith(_OUTAGE_REPLIES)), None)
    if passing is not None:
        raise redis.ResponseError(passing)
    refused = sum(n for n, r in zip(sizes, replies, strict=True) if r != 1)
    return refused, errors[0] if errors else None


class ScriptConnection:
    """Runs :data:`WRITE_SCRIPT` on a connection of its own, taken from the client's pool and kept while the
    publisher writes (:meth:`release` gives it back while idle, where the pool sweep can release it)."""

    def __init__(self, client: redis.Redis[bytes]) -> None:
        self.redis = client
        self._script_sha = hashlib.sha1(WRITE_SCRIPT.encode()).hexdigest()
        self._conn: Any = None
        """The connection of the writes, taken from ``client``'s pool by a :meth:`run` when none is held."""

    def run(self, keys: list[str], args: list[str | int]) -> list[Any]:
        """One ``EVALSHA`` of :data:`WRITE_SCRIPT` (``SCRIPT LOAD`` first when Redis does not know it: a
        first write, a restarted Redis).

        The connection is taken from the client's pool and kept until :meth:`release`: a write is then a
        send and a read, with none of the client's per-command pool, lock and retry steps, which were a
        quarter of a write's CPU. Redis not answering raises as any command does (the connection reconnects at the
        next write).

        Raises:
            redis.RedisError: the write did not run.
        """
        if self._conn is None:
            self._conn = self.redis.connection_pool.get_connection()
        conn = self._conn
        command = ("EVALSHA", self._script_sha, len(keys), *keys, *args)
        conn.send_command(*command)
        try:
            reply: list[Any] = conn.read_response()
            return reply
        except redis.exceptions.NoScriptError:
            conn.send_command("SCRIPT", "LOAD", WRITE_SCRIPT)
            conn.read_response()
        conn.send_command(*command)
        reply = conn.read_response()
        return reply

    def release(self) -> None:
        """Give the connection back to the client's pool (a later :meth:`run` takes one again)."""
        if self._conn is not None:
            self.redis.connection_pool.release(self._conn)
            self._conn = None
