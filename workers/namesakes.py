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
  (:data:`RELEASE_SCRIPT`: each beat carries the process's ``instance``).

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

__all__ = ["MAX_SUFFIX", "RELEASE_SCRIPT", "STALE_PERIODS", "free_worker_name", "live_namesake",
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
