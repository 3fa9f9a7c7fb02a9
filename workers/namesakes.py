"""One live worker per Celery hostname: a second one under the same name is refused, or given another.

A worker's name keys its heartbeat (``fleet:worker:<hostname>``), its entry in its model's live set and
its own queue. Two processes under one name (``fleet worker --model m`` started twice on one host, both
``m@host``) shared them: ``fleet status`` showed one, and when either stopped it deleted the other's
heartbeat and took the name out of the live set, so the one still running read as gone ("no live
worker serves model m") until its next beat.

* ``fleet worker`` without ``--hostname`` takes the first of ``m@host``, ``m-2@host``, ``m-3@host``, …
  that no live worker holds (:func:`free_worker_name`);
* a worker refuses to start (exit 3) under a name a live worker of another process holds
  (:func:`live_namesake`: a heartbeat that beats again), naming it and the way out (``--hostname``);
* a stopping worker deletes its heartbeat and live-set entry only while they are its own
  (:data:`RELEASE_SCRIPT`: each beat carries the process's ``instance``);
* every beat, the first included, is written only while no live worker of another process holds the name
  (:data:`BEAT_SCRIPT`, one step in Redis): two workers started under one name at the same instant both pass
  the check above (neither beats until its model is loaded), and the second to claim the name refuses to
  start then, before it takes any message.

"Live" is a heartbeat beaten within :data:`STALE_PERIODS` of its own period: the heartbeat of a worker
that was SIGKILLed lingers for three periods (its TTL), and its successor under the same name starts
once it is this old.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import redis

from protocol.keys import WORKER_KEY_PREFIX

__all__ = ["BEAT_SCRIPT", "MAX_SUFFIX", "RELEASE_SCRIPT", "STALE_PERIODS", "free_worker_name", "live_namesake",
           "namesake_message", "running_namesake"]

STALE_PERIODS = 2.5
"""A heartbeat older than this many of its periods is a stopped worker's: a live one beats every period, and
a busy one (the GIL, a loaded machine) may beat late, but its key expires at three."""
MAX_SUFFIX = 64
"""Most names ``fleet worker`` tries for one model on one host."""

RELEASE_SCRIPT = """
local doc = redis.call('GET', KEYS[1])
if doc then
  local ok, parsed = pcall(cjson.decode, doc)
  if ok and type(parsed) == 'table' and parsed['instance'] ~= nil and parsed['instance'] ~= ARGV[1] then
    return 0
  end
  redis.call('DEL', KEYS[1])
end
if #KEYS > 1 then
  redis.call('ZREM', KEYS[2], ARGV[2])
end
return 1
"""
"""KEYS: the heartbeat key [, the model's live set]; ARGV: this process's instance, its hostname. Deletes both
unless the heartbeat is another instance's (a namesake's); returns 1 when it did."""

BEAT_SCRIPT = """
local held = redis.call('GET', KEYS[1])
if held then
  local ok, doc = pcall(cjson.decode, held)
  if ok and type(doc) == 'table' and doc['instance'] ~= nil and doc['instance'] ~= ARGV[2] then
    local beat, period = tonumber(doc['heartbeat_unix_s']), tonumber(doc['heartbeat_s'])
    if beat == nil or period == nil or tonumber(ARGV[4]) - beat <= tonumber(ARGV[6]) * period then
      return held
    end
  end
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3])
if #KEYS > 1 then
  redis.call('ZADD', KEYS[2], tonumber(ARGV[4]) + tonumber(ARGV[3]), ARGV[5])
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[4])
  redis.call('EXPIRE', KEYS[2], ARGV[3])
end
return false
"""
"""KEYS: the heartbeat key [, the model's live set]; ARGV: the beat's document, this process's instance, the
TTL (s), now (unix s), the hostname, :data:`STALE_PERIODS`. Writes the beat (and the live entry) unless the key
holds a live heartbeat of another instance (not stale, as :func:`running_namesake` reads it): then it writes
nothing and returns that document. The check and the write are one step, so of two processes that start under
one name at the same instant (both passed :func:`live_namesake` before either beat) the second to beat finds
the first's heartbeat and never overwrites it."""


def running_namesake(client: redis.Redis[bytes], hostname: str, *, now_s: float | None = None,
                     instance: str | None = None) -> dict[str, Any] | None:  # fmt: skip
    """The heartbeat document of a live worker named ``hostname`` (another process than ``instance``), or None."""
    raw = client.get(WORKER_KEY_PREFIX + hostname)
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(doc, dict) or (instance is not None and doc.get("instance") == instance):
        return None
    now = time.time() if now_s is None else now_s
    beat, period = doc.get("heartbeat_unix_s"), doc.get("heartbeat_s")
    if isinstance(beat, int | float) and isinstance(period, int | float) and now - beat > STALE_PERIODS * period:
        return None  # its process stopped beating: it is gone, its key has not expired yet
    return doc


def live_namesake(client: redis.Redis[bytes], hostname: str, *, poll_s: float = 0.2,
                  clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep,
                  ) -> dict[str, Any] | None:  # fmt: skip
    """:func:`running_namesake`, made sure of: a heartbeat found is watched until it beats again (its worker
    lives: its new document is returned) or grows stale (a killed worker's: None), at most
    :data:`STALE_PERIODS` of its period. A worker restarted under its name right after a SIGKILL starts
    once its predecessor's heartbeat is stale, instead of being refused."""
    doc = running_namesake(client, hostname, now_s=clock())
    while doc is not None:
        again = running_namesake(client, hostname, now_s=clock())
        if again is None or again.get("heartbeat_unix_s") != doc.get("heartbeat_unix_s"):
            return again
        sleep(poll_s)
    return None


def namesake_message(hostname: str, doc: dict[str, Any], model: str) -> str:
    """Why a worker named ``hostname`` cannot start while ``doc``'s worker runs, and what to do instead."""
    at, _, host = hostname.partition("@")
    age = time.time() - float(doc.get("heartbeat_unix_s") or time.time())
    return (f"a worker named {hostname} is already running (pid {doc.get('pid', '?')}, model {doc.get('model', '?')}, "
            f"heartbeat {age:.1f} s ago): two workers under one name would share its heartbeat and live entry; "
            f"start this one under another name: fleet worker --model {model} --hostname {at}-2@{host or '%h'} "
            f"(celery: -n), or leave --hostname out and fleet worker picks a free one")


def free_worker_name(client: redis.Redis[bytes], model: str, host: str) -> str:
    """``model@host`` when no live worker holds that name, else ``model-2@host``, ``model-3@host``, … (the
    last tried, ``model-MAX_SUFFIX@host``, when every one is taken: the worker then refuses to start)."""
    for n in range(1, MAX_SUFFIX + 1):
        name = f"{model}@{host}" if n == 1 else f"{model}-{n}@{host}"
        if running_namesake(client, name) is None:
            return name
    return name
