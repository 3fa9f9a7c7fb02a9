"""One delivery of a generation runs at a time, and none runs once the request's outcome is stored.

A generation writes its tokens to one stream per request ID (``fleet:stream:<id>``). Two deliveries of one
ID running at once (a plain Celery client that sent a task ID twice, with the same body or not) generated
into that one stream: readers take each index once, so they saw parts of either generation, while the
stored result (the first stored wins, :mod:`broker.result_backend`) was one of them. A delivery of a
generation whose outcome was already stored (a message restored after its result was written, a
client's resend) generated it all again, and wrote tokens after its stream's end.

So before a generation starts, ``fleet.infer`` claims its ID (:meth:`RunClaims.acquire`, one run of
:data:`CLAIM_SCRIPT`):

* its outcome is stored (SUCCESS, FAILURE, REVOKED): the delivery is acked without running; nothing is
  stored (the stored outcome stays) and nothing is streamed;
* nobody holds the ID: ``SET fleet:run:<id> NX`` with this worker process's owner string, for
  ``ttl_s`` (three heartbeat periods); the delivery runs, and each heartbeat renews the claims of the
  generations this process runs (:meth:`RunClaims.renew`, one round trip for all; a claim Redis lost
  is written back);
* another delivery holds it (on any worker, this one included): this delivery waits, claiming again
  every ``poll_s``, until the outcome is stored (then it is acked as above) or the claim lapses, its
  holder gone without an outcome (then this delivery runs the generation). A waiting delivery holds
  one of the worker's C tokens but is not work this worker progresses: readiness and the overdue-slot
  report leave it out (:attr:`RunClaims.waiting`; not an ID this process also runs).

A claim that vanishes before the end of the life it had when last seen (Redis lost it: a restart without
persistence, a flush), or one last seen before Redis stopped answering, is not taken at once: its holder
may be alive and writes it back at its next heartbeat. Until that life (from the last try Redis did not
answer: one full ``ttl_s``) has passed, the waiting delivery only looks (``ARGV[3]`` of
:data:`CLAIM_SCRIPT`); a holder that wrote nothing back by then is gone, and the delivery claims.

A claim is not deleted when its generation ends: later copies read the stored outcome first, and a
claim whose delivery stored nothing lapses within ``ttl_s``. A holder whose heartbeat is late by more
than ``ttl_s`` can lose its claim to a waiting copy; the next beat logs that both run. One-step
requests are not claimed (one round trip per request, and two copies of one share no stream: the
first result stored is kept).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import redis
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from protocol.keys import RESULT_KEY, RUN_KEY
from workers.stream_write_script import bytes_to_text

__all__ = ["CLAIM_SCRIPT", "RENEW_SCRIPT", "Delivery", "RunClaims", "RunClaimsCollector", "WaitAbandoned", "owner_of"]

log = logging.getLogger("fleet.worker")

_STORED_OUTCOME_LUA = """
local function stored_outcome(key)
  local meta = redis.call('GET', key)
  if not meta then return nil end
  local ok, current = pcall(cjson.decode, meta)
  local status = ok and type(current) == 'table' and current['status']
  if status == 'SUCCESS' or status == 'FAILURE' or status == 'REVOKED' then return status end
  return nil
end
"""
"""The Lua function both scripts read a result key with: its terminal state (SUCCESS, FAILURE, REVOKED), else nil."""

CLAIM_SCRIPT = _STORED_OUTCOME_LUA + """
local status = stored_outcome(KEYS[1])
if status then
  return {'stored', status}
end
local holder = redis.call('GET', KEYS[2])
if holder then
  return {'held', holder, redis.call('PTTL', KEYS[2])}
end
if ARGV[3] == '1' then
  return {'free', ''}
end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
return {'claimed', ARGV[1]}
"""
"""Claim a generation's ID for one delivery. KEYS: its result key, its run key; ARGV: the owner string,
the claim's life (ms), and '1' to only look (a claim that vanished early may be written back by its
holder). Returns ``['stored', status]`` (a terminal outcome is stored: run nothing), ``['claimed', owner]``,
``['held', holder, life left (ms)]`` (another delivery runs it) or, when only looking, ``['free', '']``."""

RENEW_SCRIPT = _STORED_OUTCOME_LUA + """
local lost, ended = {}, {}
local claims = tonumber(ARGV[3])
for i = 1, claims do
  local holder = redis.call('GET', KEYS[i])
  if holder == ARGV[1] then
    redis.call('PEXPIRE', KEYS[i], ARGV[2])
  elseif holder then
    table.insert(lost, i)
  elseif stored_outcome(KEYS[claims + i]) then
    table.insert(ended, i)
  else
    redis.call('SET', KEYS[i], ARGV[1], 'PX', ARGV[2])
  end
end
for i = 2 * claims + 1, #KEYS do
  redis.call('ZADD', KEYS[i], 'XX', ARGV[4], ARGV[i - 2 * claims + 4])
end
return {lost, ended}
"""
"""Renew this process's claims and the visibility of its deliveries. KEYS: the claims' run keys, then their
result keys (in the same order), then one kombu unacked index per delivery; ARGV: the owner string, the claims'
life (ms), the number of run keys, now (unix s), then the deliveries' tags. A claim Redis lost is written again
unless its request's outcome is stored (another delivery ran it while this one's claim had lapsed: a heartbeat
late by more than the claim's life, a process frozen); a delivery's index score becomes now where the entry
still exists (``XX``: one acked or restored meanwhile is not written back). Returns two lists of (1-based)
claim positions: those another owner holds now, and those whose outcome is stored with no claim left."""


def owner_of(hostname: str) -> str:
    """The owner string of this worker process's claims: a fresh instance ID, then the node name (for logs)."""
    return f"{uuid.uuid4().hex} {hostname}"


def _node(holder: str) -> str:
    """The node name in an owner string (the whole string when it has none)."""
    return holder.partition(" ")[2] or holder


@dataclass
class _Wait:
    """One delivery's wait on another's claim."""

    holder: str | None = None
    """The owner string of the claim last seen (None: none seen yet, this delivery did not wait)."""
    lapse_at_s: float = 0.0
    """The earliest time (clock s) that claim can lapse: until then, finding it gone means Redis lost it."""
    unanswered: int = 0
    """Tries Redis did not answer."""
    counted: bool = False
    """Counted in :attr:`RunClaims.waiting`."""
    vanished_logged: bool = False


@dataclass(frozen=True)
class Delivery:
    """Where kombu keeps one delivery's unacked entry: the index (a sorted set scored by delivery time, unix s,
    which the visibility-timeout restore scans) and the delivery's tag."""

    index_key: str
    tag: str


class WaitAbandoned(Exception):
    """A delivery waiting on another's claim stopped waiting: its worker is shutting down (warm). Its message is
    to go back to the queue (requeued), where a worker that stays takes it up."""


class RunClaims:
    """The generation IDs this worker process claimed, and the deliveries waiting on another's claim (thread-safe)."""

    def __init__(self, client: redis.Redis[bytes], *, owner: str, ttl_s: float, poll_s: float | None = None,
                 sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        """``owner``: this process's owner string (:func:`owner_of`); ``ttl_s``: a claim's life without a
        renewal (s); ``poll_s``: how often a waiting delivery claims again (s; default a sixth of ``ttl_s``,
        0.05 to 0.5); ``clock``: monotonic seconds (when a claim seen can lapse at the earliest)."""
        self._claim_script: Any = client.register_script(CLAIM_SCRIPT)
        self._renew_script: Any = client.register_script(RENEW_SCRIPT)
        self.owner = owner
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.poll_s = poll_s if poll_s is not None else min(0.5, max(0.05, ttl_s / 6))
        self._sleep = sleep
        self._clock = clock
        self._held: set[str] = set()
        self._visible: dict[str, tuple[str, str]] = {}
        """Delivery tag → (request ID, unacked index key) of the deliveries whose visibility each beat renews."""
        self._waiting: dict[str, int] = {}
        """Request ID → deliveries of it waiting here now."""
        self._lock = threading.Lock()
        self.skipped_stored = 0
        """Deliveries acked without running because the outcome was stored (at once or after a wait)."""
        self.waited = 0
        """Deliveries that found another delivery running the same ID and waited."""
        self.taken_over = 0
        """Waiting deliveries that ran the generation after the holder's claim lapsed without an outcome."""
        self._refused_logged = False
        self._shutting_down = threading.Event()
        self.ended_elsewhere = 0
        """Generations this process ran whose outcome another delivery stored while their claim had lapsed."""
        self.on_ended_elsewhere: Callable[[str], None] | None = None
        """Called (on the heartbeat's thread) with the ID of such a generation: the worker stops it at its next
        step, as a cancel does (:meth:`workers.cancel_listener.CancelListener.flag`); its own outcome, stored
        after the other's, is refused (:mod:`broker.result_backend`: the first stored is kept)."""

    @property
    def waiting(self) -> frozenset[str]:
        """The request IDs of deliveries waiting on another's claim now, less those this process also runs
        (a delivery of the same ID that holds the claim here is work this worker progresses)."""
        with self._lock:
            return frozenset(self._waiting.keys() - self._held)

    def abandon_waits(self) -> None:
        """The worker is shutting down: every delivery waiting on another's claim, now or later, raises
        :class:`WaitAbandoned` at its next try (within ``poll_s``), so a warm shutdown waits only for the
        generations this worker runs. A signal handler calls it: it only sets an event."""
        self._shutting_down.set()

    def held(self) -> list[str]:
        """The request IDs this process holds claims for."""
        with self._lock:
            return sorted(self._held)

    def acquire(self, request_id: str, on_wait: Callable[[], None] | None = None,
                delivery: Delivery | None = None) -> bool:  # fmt: skip
        """Claim ``request_id`` for this delivery, waiting while another delivery holds it (``on_wait`` is
        called once when the wait starts). While the delivery waits here or runs the generation, each
        heartbeat renews its ``delivery``'s visibility (:meth:`renew`): kombu restores a message held past
        ``visibility_timeout_s`` to the queue, and a generation that runs longer (or a copy waiting for one)
        was delivered again once per timeout, each copy holding a worker token; a worker that dies stops
        renewing, and its message comes back one timeout after its last beat.

        Returns True when this delivery is to run the generation (its claim renewed until :meth:`release`),
        False when the request's outcome is stored (run, store and stream nothing). Redis not answering is
        waited out (nothing can be stored meanwhile either); a Redis that refuses the script (an ACL) lets the
        delivery run unclaimed, as before claims existed (logged once). A claim that vanished before its life
        ended, or one last seen before Redis stopped answering, is taken only once that life has passed (see
        the module doc).

        Raises:
            WaitAbandoned: the worker began a warm shutdown while this delivery waited (:meth:`abandon_waits`).
        """
        keys = [RESULT_KEY.format(id=request_id), RUN_KEY.format(id=request_id)]
        wait = _Wait()
        runs = False
        if delivery is not None:
            with self._lock:
                self._visible[delivery.tag] = (request_id, delivery.index_key)
        try:
            while True:
                asked_s = self._clock()
                look_only = wait.holder is not None and asked_s < wait.lapse_at_s
                try:
                    reply = [bytes_to_text(v) for v in self._claim_script(keys=keys, args=[self.owner, self.ttl_ms,
                                                                                   int(look_only)])]  # fmt: skip
                except (redis.ConnectionError, redis.TimeoutError) as exc:
                    self._unanswered(request_id, wait, exc)
                    self._sleep(self.poll_s)
                    continue
                if reply[0] == "claimed":
                    runs = self._claimed(request_id, wait.holder)
                    return runs
                if reply[0] == "stored":
                    self._skip(request_id, reply[1], wait.holder)
                    return False
                self._wait_on(request_id, reply, wait, asked_s, on_wait)
                if self._shutting_down.is_set():
                    log.warning("generation %s: this worker is shutting down; the delivery waiting for its outcome "
                                "goes back to the queue", request_id)  # fmt: skip
                    raise WaitAbandoned(f"generation {request_id}: the worker is shutting down")
                self._sleep(self.poll_s)
        except redis.ResponseError as exc:
            if not self._refused_logged:
                self._refused_logged = True
                log.warning("Redis refused the run-claim script (%s): generations run without a claim, so two "
                            "deliveries of one ID can run at once", exc)  # fmt: skip
            runs = True
            return runs
        finally:
            if wait.counted:
                self._stop_waiting(request_id)
            if delivery is not None and not runs:  # acked without running, or back to the queue: not renewed
                with self._lock:
                    self._visible.pop(delivery.tag, None)

    def _wait_on(self, request_id: str, reply: list[str], wait: _Wait, asked_s: float,
                 on_wait: Callable[[], None] | None) -> None:  # fmt: skip
        """A try that found the ID held (``['held', holder, life left ms]``), or, only looking, not held."""
        if reply[0] == "held":
            if wait.holder is None:
                self._start_waiting(request_id, reply[1], wait)
                if on_wait is not None:
                    on_wait()
            wait.holder = reply[1]
            wait.lapse_at_s = asked_s + int(reply[2]) / 1000  # it cannot lapse before this
        elif not wait.vanished_logged:
            wait.vanished_logged = True
            log.warning("generation %s: the claim of %s vanished before its life ended (Redis lost it?): waiting "
                        "%.1f s more for its holder to write it back before running it", request_id,
                        _node(wait.holder or "") or "another delivery", wait.lapse_at_s - asked_s)  # fmt: skip

    def _unanswered(self, request_id: str, wait: _Wait, exc: redis.RedisError) -> None:
        """A try Redis did not answer: logged once per delivery; a holder seen before cannot renew meanwhile,
        so its claim is not taken until a full life after Redis answers again (its next beat writes it back)."""
        if not wait.unanswered:  # once per delivery: the heartbeat reports the outage itself
            log.warning("claiming generation %s: Redis does not answer (%s); trying again every %.2f s",
                        request_id, exc, self.poll_s)  # fmt: skip
        wait.unanswered += 1
        if wait.holder is not None:
            wait.lapse_at_s = max(wait.lapse_at_s, self._clock() + self.ttl_ms / 1000)

    def _claimed(self, request_id: str, waited_for: str | None) -> bool:
        with self._lock:
            self._held.add(request_id)
        if waited_for is not None:
            self.taken_over += 1
            log.warning("generation %s: the claim of %s lapsed without an outcome (its worker is gone): this "
                        "delivery runs it", request_id, _node(waited_for) or "another delivery")  # fmt: skip
        return True

    def _skip(self, request_id: str, status: str, waited_for: str | None) -> None:
        self.skipped_stored += 1
        after = f" after waiting for {_node(waited_for) or 'another delivery'}" if waited_for is not None else ""
        log.info("generation %s already has its outcome stored (%s)%s: this delivery is acked without running",
                 request_id, status, after)  # fmt: skip

    def _start_waiting(self, request_id: str, holder: str, wait: _Wait) -> None:
        self.waited += 1
        wait.counted = True
        with self._lock:
            self._waiting[request_id] = self._waiting.get(request_id, 0) + 1
        log.warning("generation %s is already running (claimed by %s): this delivery waits for its outcome instead "
                    "of generating into the same stream", request_id, _node(holder) or "another delivery")  # fmt: skip

    def _stop_waiting(self, request_id: str) -> None:
        with self._lock:
            self._waiting[request_id] -= 1
            if not self._waiting[request_id]:
                del self._waiting[request_id]

    def release(self, request_id: str) -> None:
        """``request_id``'s delivery is done here (its outcome stored, or not to be): stop renewing its claim,
        which lapses within its life; a trace hook (:func:`workers.trace_guard.on_traced`), so no Redis."""
        with self._lock:
            self._held.discard(request_id)
            for tag in [tag for tag, (rid, _) in self._visible.items() if rid == request_id]:
                del self._visible[tag]

    def renew(self, _expires_unix_s: float = 0.0) -> None:
        """Renew every claim this process holds and the visibility of every delivery that runs or waits here,
        in one round trip (a heartbeat hook: the argument is not used); logs a claim that another owner holds
        now (both deliveries then run).

        Raises:
            redis.RedisError: Redis did not answer, or refused (the heartbeat logs it; the next beat tries again).
        """
        held = self.held()
        with self._lock:
            visible = list(self._visible.items())
        if not held and not visible:
            return
        keys = ([RUN_KEY.format(id=rid) for rid in held] + [RESULT_KEY.format(id=rid) for rid in held]
                + [index_key for _, (_, index_key) in visible])  # fmt: skip
        args = [self.owner, self.ttl_ms, len(held), repr(time.time()), *(tag for tag, _ in visible)]
        lost, ended = self._renew_script(keys=keys, args=args) or ([], [])
        for position in lost:
            self.release(held[int(position) - 1])  # logged once: not renewed from here on
            log.warning("generation %s: its claim lapsed (this worker's heartbeat was late by more than %.1f s) and "
                        "another delivery took it: both run", held[int(position) - 1], self.ttl_ms / 1000)  # fmt: skip
        for position in ended:
            rid = held[int(position) - 1]
            self.release(rid)
            self.ended_elsewhere += 1
            log.warning("generation %s: its claim lapsed (this worker's heartbeat was late by more than %.1f s) and "
                        "another delivery ran it to its end: stopped here, the stored result kept", rid,
                        self.ttl_ms / 1000)  # fmt: skip
            if self.on_ended_elsewhere is not None:
                self.on_ended_elsewhere(rid)


class RunClaimsCollector(Collector):
    """``fleet_worker_generation_copies_total{model,outcome}``: deliveries of a generation's ID that found its
    outcome stored (``skipped``: acked without running), found another delivery running it (``waited``), or
    ran it after that delivery's claim lapsed without an outcome (``took_over``), or ran it here and were stopped
    when another delivery had stored its outcome meanwhile (``ended_elsewhere``)."""

    def __init__(self, model: str, claims: RunClaims) -> None:
        self.model = model
        self.claims = claims

    def collect(self) -> Iterable[Any]:
        family = CounterMetricFamily("fleet_worker_generation_copies",
                                     "Deliveries of a generation ID that another delivery held or finished.",
                                     labels=["model", "outcome"])  # fmt: skip
        for outcome, count in (("skipped", self.claims.skipped_stored), ("waited", self.claims.waited),
                               ("took_over", self.claims.taken_over),
                               ("ended_elsewhere", self.claims.ended_elsewhere)):  # fmt: skip
            family.add_metric([self.model, outcome], count)
        yield family
