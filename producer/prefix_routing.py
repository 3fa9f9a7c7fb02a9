"""Prefix-aware routing: a generation goes to the live worker that holds the longest prefix of its prompt.

Each worker publishes the token-prefix block digests its prefix cache holds
(:data:`protocol.keys.PREFIX_HOLDER_KEY`, :mod:`workers.direct_queue`). At submit, for a generation of
a model with ``routing.prefix_aware`` on, :class:`PrefixRouter` digests the prompt's blocks
(:func:`protocol.prefix_digest.block_digests`, all but the last token: one is always computed), and
in one pipelined round trip asks the set of every live worker that consumes a queue of its own which of
them it holds and how long that queue is. :func:`pick_holder` chooses the worker holding the most blocks
whose queue is under ``routing.max_direct_queued``; the request goes to that worker's own queue. No holder,
or every holder busy past the bound: the model's queue, where any worker takes it. With one live worker
there is nothing to choose: no lookup is made and the model's queue reaches that worker.

Only a worker registered in :data:`protocol.keys.DIRECT_QUEUES_KEY` past now is a candidate, whatever its
set says: a worker that does not consume its own queue (routing off in its config, say after a restart
under the name of a worker that did, whose set lingers for its TTL) never gets requests sent there.

A hint, never a promise: a digest may be stale (evicted since), and a worker that dies leaves its
queue to the others (:class:`workers.direct_queue.DirectQueue`). The live workers are read at most
once per ``cache_s``. A Redis without ``SMISMEMBER`` (< 6.2) turns routing off for the process with a
warning.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import redis

from protocol.celeryconf import routes_by_prefix
from protocol.keys import DIRECT_QUEUES_KEY, LIVE_WORKERS_KEY, PREFIX_HOLDER_KEY
from protocol.prefix_digest import block_digests
from protocol.settings import FleetSettings

__all__ = ["Holder", "PrefixRouter", "pick_holder"]

log = logging.getLogger("fleet.routing")

LIVE_CACHE_S = 1.0
"""How long the list of a model's live workers is reused (s)."""


@dataclass(frozen=True)
class Holder:
    """What one live worker holds of a prompt."""

    host: str
    blocks: int
    """Leading prompt blocks whose digests it holds (0: none)."""
    queued: int
    """Requests waiting in its own queue."""


def pick_holder(holders: Sequence[Holder], max_queued: int) -> Holder | None:
    """The worker to route to (pure): the most blocks held, then the shortest queue, then the name; only
    workers with ``blocks`` > 0 and ``queued`` < ``max_queued``. None: route to the model's queue."""
    usable = [h for h in holders if h.blocks > 0 and h.queued < max_queued]
    if not usable:
        return None
    return min(usable, key=lambda h: (-h.blocks, h.queued, h.host))


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def held_blocks(flags: Sequence[int | bool]) -> int:
    """Blocks held from the digests' membership flags: the deepest flag set (digests chain, so holding
    block k's digest means holding its whole prefix)."""
    for k in range(len(flags) - 1, -1, -1):
        if flags[k]:
            return k + 1
    return 0


class PrefixRouter:
    """Chooses a worker's own queue for a generation; thread-safe. ``clock``: monotonic seconds."""

    def __init__(
        self, client: redis.Redis[bytes], settings: FleetSettings, *, cache_s: float = LIVE_CACHE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.settings = settings
        self.cache_s = cache_s
        self.clock = clock
        self._live: dict[str, tuple[float, list[str], list[str]]] = {}
        self._lock = threading.Lock()
        self.disabled = False
        """Set when Redis refused the lookup (no SMISMEMBER): every request goes to the model's queue."""
        self.routed = 0
        """Generations sent to a worker's own queue."""
        self.unrouted = 0
        """Generations sent to the model's queue: no holder, every holder busy, or one live worker (no lookup)."""
        self.passed_over = 0
        """Of ``unrouted``: those a live worker held, passed over for its queue at ``max_direct_queued``."""

    def live_hosts(self, model: str) -> list[str]:
        """The hostnames of ``model``'s live workers, at most ``cache_s`` old."""
        return self._hosts(model)[0]

    def _hosts(self, model: str) -> tuple[list[str], list[str]]:
        """:meth:`live_hosts`, and those of them that consume a queue of their own (registered in
        :data:`~protocol.keys.DIRECT_QUEUES_KEY` past now), read together."""
        now = self.clock()
        with self._lock:
            cached = self._live.get(model)
        if cached is not None and now - cached[0] < self.cache_s:
            return cached[1], cached[2]
        wall_s = time.time()
        with self.client.pipeline(transaction=False) as pipe:
            pipe.zrangebyscore(LIVE_WORKERS_KEY.format(model=model), wall_s, "+inf")
            pipe.zrangebyscore(DIRECT_QUEUES_KEY.format(model=model), wall_s, "+inf")
            live_raw, direct_raw = pipe.execute()
        hosts = sorted(_text(h) for h in live_raw)
        consuming = {_text(h) for h in direct_raw}
        direct = [h for h in hosts if h in consuming]
        with self._lock:
            self._live[model] = (now, hosts, direct)
        return hosts, direct

    def holders(self, model: str, prompts: Sequence[Sequence[int]]) -> list[list[Holder]]:
        """What each live worker of ``model`` that consumes a queue of its own holds of each of ``prompts``
        (one round trip for them all).

        No round trip, and no holder, when no prompt has a whole block, fewer than two workers are
        live, or none consumes a queue of its own: a lone worker takes from the model's queue as well as its
        own, so a lookup could only choose the worker that serves the request anyway, and its own queue is
        where an idle worker looks only every ``routing.direct_wait_ms``."""
        model = self.settings.model_key(model)
        block = self.settings.models[model].batching.prefix_block_tokens
        digests = [block_digests(prompt[: max(0, len(prompt) - 1)], block) for prompt in prompts]
        live, hosts = self._hosts(model) if any(digests) else ([], [])
        if len(live) < 2 or not hosts:
            return [[] for _ in prompts]
        looked_up = [d for d in digests if d]
        with self.client.pipeline(transaction=False) as pipe:
            for host in hosts:
                pipe.llen(self.settings.direct_queue_for(model, host))
            for wanted in looked_up:
                for host in hosts:
                    pipe.smismember(PREFIX_HOLDER_KEY.format(model=model, host=host), wanted)  # type: ignore[no-untyped-call]
            replies = pipe.execute()
        queued = [int(n) for n in replies[: len(hosts)]]
        flags = iter(replies[len(hosts) :])
        out: list[list[Holder]] = []
        for wanted in digests:
            if not wanted:
                out.append([])
                continue
            out.append([Holder(host, held_blocks(next(flags)), queued[i]) for i, host in enumerate(hosts)])
        return out

    def direct_queue(self, model: str, prompt: Sequence[int]) -> str | None:
        """The own queue of the worker to send this generation to, or None (the model's queue)."""
        return self.direct_queues(model, [prompt])[0]

    def direct_queues(self, model: str, prompts: Sequence[Sequence[int]]) -> list[str | None]:
        """:meth:`direct_queue` for generations of ``model`` sent together, with one round trip for them
        all. Each one routed to a worker counts in that worker's queue for the ones after it, as it will
        once they are queued, so ``routing.max_direct_queued`` bounds the group as it bounds single sends."""
        if self.disabled or not routes_by_prefix(self.settings, model) or not prompts:
            return [None] * len(prompts)
        try:
            holders = self.holders(model, prompts)
        except redis.ResponseError as exc:
            self.disabled = True
            log.warning("prefix-aware routing is off for this process: Redis refused the lookup (%s)", exc)
            return [None] * len(prompts)
        key = self.settings.model_key(model)
        bound = self.settings.model(model).routing.max_direct_queued
        added: dict[str, int] = {}
        out: list[str | None] = []
        for found in holders:
            chosen = pick_holder([replace(h, queued=h.queued + added.get(h.host, 0)) for h in found], bound)
            if chosen is None:
                self.unrouted += 1
                self.passed_over += any(h.blocks for h in found)
                out.append(None)
                continue
            self.routed += 1
            added[chosen.host] = added.get(chosen.host, 0) + 1
            out.append(self.settings.direct_queue_for(key, chosen.host))
        return out
