"""The worker's result backend: Celery's Redis backend, retrying writes Redis refuses for a while.

A result write that fails is worse than a slow one: Celery then acks the message (acks_late acks a
failed task too), so the request is gone with no result. With ``result_backend_always_retry`` Celery
retries a store whose error its backend calls safe to retry; Redis's own backend counts only lost
connections. These classes add Redis's temporary write refusals (``MISCONF``, ``NOREPLICAS``,
``READONLY``, ``OOM``, ``MASTERDOWN``: :func:`broker.redis_refusals.is_write_refusal`), so a task
thread holds its request (and its token) until the result is written, and the request is never
acked without one.

Each result is also written by one Lua script (:class:`_StoresWithOneScript`) instead of Celery's
``GET`` (is a SUCCESS already stored?) followed by ``MULTI``/``SETEX``/``PUBLISH``/``EXEC``: one round
trip and 3 Redis commands (``EVALSHA``, ``SET``, ``PUBLISH``) instead of two round trips and 5, and the
check and the write are one atomic step, so a redelivered request's late result can no longer
overwrite an outcome another worker stored in between (Celery's check-then-write leaves that window),
and no outcome is ever overwritten: the first SUCCESS, FAILURE or REVOKED stored is the request's.

Installed for the worker's app only (:func:`install`): producers keep Celery's behaviour of raising.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

from celery import Celery, current_task, states
from celery.backends.base import BackendStoreError
from celery.backends.redis import RedisBackend, SentinelBackend
from kombu.utils.encoding import bytes_to_str

from broker.redis_refusals import is_write_refusal
from broker.store_ack import ACKS, delivery_tag_of
from protocol.keys import OWNER_KEY, OWNERS_HEADER, REQUEST_KEY, TAKEN_KEY
from protocol.redis_pools import SweepingPool, SweepingSentinelPool

__all__ = ["RESULT_WRITE_MAX_SLEEP_MS", "RESULT_WRITE_RETRIES", "STORE_RESULT_SCRIPT", "RefusalTolerantRedisBackend",
           "RefusalTolerantSentinelBackend", "install", "message_owners"]

RESULT_WRITE_RETRIES = 3600
"""Retries of one result write (at most :data:`RESULT_WRITE_MAX_SLEEP_MS` apart: about an hour)."""
RESULT_WRITE_MAX_SLEEP_MS = 1000
"""Longest wait between two tries of a result write, in milliseconds (exponential from 10 ms)."""


class _RetriesWriteRefusals:
    """The retry rule both backends share: Celery's own, plus Redis's temporary write refusals."""

    def exception_safe_to_retry(self, exc: BaseException) -> bool:
        return bool(super().exception_safe_to_retry(exc)) or is_write_refusal(exc)  # type: ignore[misc]


STORE_RESULT_SCRIPT = """
local ttl = tonumber(ARGV[2])
local function write()
  if ttl > 0 then return redis.call('SET', KEYS[1], ARGV[1], 'EX', ttl) end
  return redis.call('SET', KEYS[1], ARGV[1])
end
local function ack()
  if #KEYS == 6 then
    redis.call('HDEL', KEYS[5], ARGV[3])
    redis.call('ZREM', KEYS[6], ARGV[3])
  end
end
local function forget_take()  -- an outcome is stored: the take's note has served (protocol.cancel_marks)
  if ARGV[5] == '1' then redis.call('DEL', KEYS[4]) end
end
local stored
if ttl > 0 then
  stored = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ttl)
else
  stored = redis.call('SET', KEYS[1], ARGV[1], 'NX')
end
if not stored then
  local ok, current = pcall(cjson.decode, redis.call('GET', KEYS[1]))
  local status = ok and type(current) == 'table' and current['status']
  if status == 'SUCCESS' or status == 'FAILURE' or status == 'REVOKED' then
    ack()
    forget_take()
    return 0
  end
  write()
end
local owner = ARGV[4]
if owner and owner ~= '' then
  if ttl > 0 then redis.call('SET', KEYS[3], owner, 'NX', 'EX', ttl) else redis.call('SET', KEYS[3], owner, 'NX') end
end
for k = 2, 3 do
  if ttl > 0 then redis.call('EXPIRE', KEYS[k], ttl) else redis.call('PERSIST', KEYS[k]) end
end
redis.call('PUBLISH', KEYS[1], ARGV[1])
ack()
forget_take()
return 1
"""
"""Store one result unless a terminal state (SUCCESS, FAILURE, REVOKED) is stored already: a stored
outcome never changes (a redelivered copy, a duplicate task ID, a bulk message naming a finished request);
publish it when stored. KEYS[1]: the result key; KEYS[2]: the request's submit marker (``fleet:req:<id>``,
:data:`protocol.keys.REQUEST_KEY`); KEYS[3]: its owner mark (``fleet:owner:<id>``,
:data:`protocol.keys.OWNER_KEY`, given the result's TTL like the marker, so another API key never reads a
result its mark outlived); KEYS[4]: its taken note (``fleet:taken:<id>``, :data:`protocol.keys.TAKEN_KEY`),
deleted with an outcome (ARGV[5] = '1': SUCCESS, FAILURE, REVOKED), so a note lives as long as its request is
held, not the visibility timeout (an hour of one key per request at thousands a second); ARGV[1]: the encoded
(JSON) meta; ARGV[2]: time to live in seconds (0 = none). With KEYS[5] and KEYS[6] (kombu's unacked hash and
index) and ARGV[3] (a delivery tag), the delivery is acked in the same step, hash entry first as kombu does
(:mod:`broker.store_ack`). ARGV[4] (absent or '': none): the
owner the task message carried (its ``fleet_owners`` header, :data:`protocol.keys.OWNERS_HEADER`), written as
the mark where the mark is missing (``SET NX``, the result's TTL), in the same step as the result: a mark Redis
lost while the request waited or ran (a restart without persistence, a flush) is back before the result can be
read, so no other API key reads it (before, the marker came back and the mark did not: any key read the result).

The marker, which says which body the ID names, is given the result's time to live when the result is
written: it was set to that TTL at submit, so it would otherwise expire a queue wait and a run before the
result, and in between a resubmit of the ID with another body was answered with the first body's result
instead of refused (:mod:`producer.idempotent_queue`). A request queued without one (a plain Celery
client) has no marker, and ``EXPIRE`` of a missing key does nothing.

Returns 1 when written, 0 when a terminal state was kept. The usual case (no state stored yet) is one
``SET NX``, one ``EXPIRE`` and one ``PUBLISH``; a stored STARTED (a generation's) is read and overwritten."""


class _StoresWithOneScript:
    """Celery's ``_store_result`` (same meta, same size limit; a stored outcome is never overwritten),
    done by :data:`STORE_RESULT_SCRIPT` in one round trip; :meth:`store_many` stores many in one pipeline."""

    _store_script: Any = None

    def _stored_form(self, task_id: Any, result: Any, state: str, traceback: Any = None,
                     request: Any = None) -> tuple[list[Any], Any, int]:  # fmt: skip
        """The script's keys (the result's, the request marker's, the owner mark's, the taken note's), the encoded
        meta (as Celery's backend writes it) and its time to live (s, 0 = none)."""
        backend: Any = self
        meta = backend._get_result_meta(result=result, state=state, traceback=traceback, request=request)
        meta["task_id"] = bytes_to_str(task_id)  # type: ignore[no-untyped-call]
        value = backend.encode(meta)
        if isinstance(value, str) and len(value) > backend._MAX_STR_VALUE_SIZE:
            raise BackendStoreError("value too large for Redis backend", state=state, task_id=task_id)
        expires = getattr(backend, "failure_expires", backend.expires) if state == states.FAILURE else backend.expires
        ttl = int(expires.total_seconds()) if hasattr(expires, "total_seconds") else int(expires or 0)
        rid = bytes_to_str(task_id)  # type: ignore[no-untyped-call]
        keys = [backend.get_key_for_task(task_id), REQUEST_KEY.format(id=rid), OWNER_KEY.format(id=rid),
                TAKEN_KEY.format(id=rid)]
        return keys, value, max(0, ttl)

    def store_many(self, outcomes: Sequence[tuple[str, str, Any]]) -> int:
        """Store each ``(task_id, state, result or exception)`` as Celery's ``store_result`` would, by the
        same script (a stored outcome is kept), in one pipeline; no delivery is acked. Returns how many
        were written. Retried like one store while Redis does not answer or refuses writes."""
        backend: Any = self
        rows = [self._stored_form(task_id, backend.encode_result(result, state), state)
                for task_id, state, result in outcomes]  # fmt: skip
        ends = [_ends(state) for _, state, _ in outcomes]
        owners = message_owners(getattr(current_task, "request", None))  # the bulk message's, in its task thread
        marks = [owners.get(str(task_id), "") for task_id, _, _ in outcomes]

        def run() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)  # type: ignore[attr-defined]
            for (keys, value, ttl), owner, end in zip(rows, marks, ends, strict=True):
                self._script()(keys=keys, args=[value, ttl, "", owner, end], client=pipe)
            return list(pipe.execute())

        return sum(int(written) for written in backend.ensure(run, ()))

    def _store_result(self, task_id: Any, result: Any, state: str, traceback: Any = None, request: Any = None,
                      **kwargs: Any) -> Any:  # fmt: skip
        backend: Any = self
        keys, value, ttl = self._stored_form(task_id, result, state, traceback, request)
        owner = message_owners(request).get(str(bytes_to_str(task_id)), "")  # type: ignore[no-untyped-call]
        tag = delivery_tag_of(request) if state == states.SUCCESS else None
        unacked = ACKS.keys_for(tag) if tag is not None else None
        if tag is not None and unacked is not None:
            ACKS.storing(tag)  # its token is free from here: the result may reach its caller before the next line
            try:
                backend.ensure(self._run_store_script, ([*keys, *unacked], [value, ttl, tag, owner, _ends(state)]))
            except BaseException:
                ACKS.store_failed(tag)  # not acked: Celery's own ack follows, and the token is held again
                raise
            ACKS.acked(tag)  # Celery's ack that follows touches no key (broker.store_ack)
        else:
            backend.ensure(self._run_store_script, (keys, [value, ttl, "", owner, _ends(state)]))
        return result

    def _script(self) -> Any:
        if self._store_script is None:
            self._store_script = self.client.register_script(STORE_RESULT_SCRIPT)  # type: ignore[attr-defined]
        return self._store_script

    def _run_store_script(self, keys: list[Any], args: list[Any]) -> Any:
        return self._script()(keys=keys, args=args, client=self.client)  # type: ignore[attr-defined]


def _ends(state: str) -> str:
    """The store script's ARGV[5]: '1' for an outcome (its request's taken note is deleted), '' for STARTED."""
    return "1" if state in states.READY_STATES else ""


def message_owners(request: Any) -> dict[str, str]:
    """Request ID -> owner from a task request's ``fleet_owners`` header (:data:`protocol.keys.OWNERS_HEADER`; Celery
    gives a message's headers as the request's attributes); empty for none (a plain Celery client's message, a
    store outside a task) or a header that is not such a map (never trusted further than its strings)."""
    carried = getattr(request, OWNERS_HEADER, None) if request is not None else None
    if carried is None and request is not None:
        carried = (getattr(request, "headers", None) or {}).get(OWNERS_HEADER)
    if not isinstance(carried, dict):
        return {}
    return {rid: owner for rid, owner in carried.items() if isinstance(rid, str) and isinstance(owner, str)}


class RefusalTolerantRedisBackend(_RetriesWriteRefusals, _StoresWithOneScript, RedisBackend):  # type: ignore[misc]
    """Celery's Redis backend; a write Redis refuses for now is retried like a lost connection.

    Celery gives each task thread a backend of its own (the Redis backend is not ``thread_safe``), and each
    built a pool of its own; here they share one per process and URL (redis-py's pool is thread-safe), a
    :class:`protocol.redis_pools.SweepingPool`: after a Redis restart, the first write that finds its
    connection closed disconnects every idle one Redis closed, instead of each staying half-closed until
    its own thread writes again."""

    def _get_pool(self, **params: Any) -> SweepingPool:
        return _shared_pool(params, lambda: SweepingPool(**params))


_POOLS: dict[str, Any] = {}
_POOLS_LOCK = threading.Lock()


_Pool = TypeVar("_Pool")


def _shared_pool(params: dict[str, Any], make: Callable[[], _Pool]) -> _Pool:
    """The process's one pool for these connection parameters, made by ``make`` on first use."""
    key = repr(sorted(params.items(), key=lambda item: item[0]))
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None:
            pool = _POOLS[key] = make()
        return cast(_Pool, pool)


class RefusalTolerantSentinelBackend(_RetriesWriteRefusals, _StoresWithOneScript, SentinelBackend):  # type: ignore[misc]
    """Celery's Sentinel backend with the same retry rule (``READONLY`` during a failover, …).

    As with the plain backend, the task threads share one pool per process (Celery's ``_get_pool`` made a
    Sentinel manager and a master pool per thread): a :class:`protocol.redis_pools.SweepingSentinelPool`, whose
    every new connection asks the sentinels where the master is, so the shared pool follows a failover."""

    def _get_pool(self, **params: Any) -> SweepingSentinelPool:
        options = self._transport_options
        key = {**params, "_sentinel": (options.get("master_name"), options.get("min_other_sentinels", 0),
                                       repr(options.get("sentinel_kwargs", {})))}  # fmt: skip
        return _shared_pool(key, lambda: self._sentinel_pool(params))

    def _sentinel_pool(self, params: dict[str, Any]) -> SweepingSentinelPool:
        """Celery's ``SentinelBackend._get_pool``, with the sweeping pool class."""
        credentials = {k: params[k] for k in ("username", "password") if k in params}
        master = self._get_sentinel_instance(**params).master_for(
            service_name=self._transport_options.get("master_name", None), redis_class=self._get_client(),
            connection_pool_class=SweepingSentinelPool, **credentials,
        )
        pool: SweepingSentinelPool = master.connection_pool
        return pool


def install(app: Celery) -> None:
    """Make ``app`` (the worker's, before its backend is first used) store results through these classes."""
    here = f"{__name__}:"
    overrides: dict[str, Any] = {
        "redis": here + RefusalTolerantRedisBackend.__name__,
        "rediss": here + RefusalTolerantRedisBackend.__name__,
        "sentinel": here + RefusalTolerantSentinelBackend.__name__,
    }
    app.loader.override_backends = {**app.loader.override_backends, **overrides}
    app.conf.result_backend_always_retry = True
    app.conf.result_backend_max_retries = RESULT_WRITE_RETRIES
    app.conf.result_backend_max_sleep_between_retries_ms = RESULT_WRITE_MAX_SLEEP_MS
