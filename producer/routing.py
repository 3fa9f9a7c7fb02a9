"""Where a request is queued: its model's stable queue or canary queue (:mod:`protocol.model_state`).

The producer and the gateway decide at submit time with :class:`Router` (a generation may go to one
worker's own queue instead: :mod:`producer.prefix_routing`), which reads each model's
state from Redis at most once per ``STATE_CACHE_S`` (1 s): a change of the canary split reaches new
submissions within a second, and a busy producer costs Redis one GET per model per second, not one
per request. Requests already queued stay where they are (workers consume both queues).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import redis

from producer.prefix_routing import PrefixRouter
from protocol.model_state import ModelState, Role, read_state, record_recent_prompt, route, samples_prompt
from protocol.settings import FleetSettings

__all__ = ["STATE_CACHE_S", "Router"]

STATE_CACHE_S = 1.0
"""How long a model's state read from Redis is reused for routing (s)."""


class Router:
    """Chooses the queue of each request; thread-safe.

    ``clock`` (monotonic seconds) is injectable for tests of the cache.
    """

    def __init__(
        self,
        client: redis.Redis[bytes],
        settings: FleetSettings,
        *,
        cache_s: float = STATE_CACHE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.settings = settings
        self.cache_s = cache_s
        self.clock = clock
        self._states: dict[str, tuple[float, ModelState | None]] = {}
        self._lock = threading.Lock()
        self.prefixes = PrefixRouter(client, settings, clock=clock)
        """Prefix-aware routing of generations (counters: ``routed``, ``unrouted``)."""

    def state(self, model: str) -> ModelState | None:
        """Model ``model``'s (a configured key) state, at most ``cache_s`` old."""
        now = self.clock()
        with self._lock:
            cached = self._states.get(model)
        if cached is not None and now - cached[0] < self.cache_s:
            return cached[1]
        state = read_state(self.client, model)
        with self._lock:
            self._states[model] = (now, state)
        return state

    def role(self, model: str, routing_key: str) -> Role:
        """``stable`` or ``canary`` for a request of ``model`` with this routing key (sticky)."""
        return route(self.state(model), routing_key)

    def queue(self, model: str, role: Role) -> str:
        """The Celery queue of ``role`` for ``model``."""
        return self.settings.canary_queue_for(model) if role == "canary" else self.settings.queue_for(model)

    def choose(self, model: str, routing_key: str, generate_from: Sequence[int] | None = None) -> str:
        """The queue a request of ``model`` with ``routing_key`` goes to now.

        ``generate_from``: the prompt of a generation. A stable-role generation goes to the own queue
        of the live worker holding the longest prefix of it, when one does and is not busy past the
        bound (:mod:`producer.prefix_routing`)."""
        return self.choose_many([(model, routing_key, generate_from)])[0]

    def choose_many(self, sends: Sequence[tuple[str, str, Sequence[int] | None]]) -> list[str]:
        """:meth:`choose` for requests sent together (``(model, routing_key, generate_from)`` each): the
        generations of one model are looked up in one round trip (:meth:`PrefixRouter.direct_queues`)."""
        roles = [self.role(model, key) for model, key, _ in sends]
        queues = [self.queue(model, role) for (model, _, _), role in zip(sends, roles, strict=True)]
        by_model: dict[str, list[int]] = {}
        for i, ((model, _, prompt), role) in enumerate(zip(sends, roles, strict=True)):
            if role == "stable" and prompt is not None:
                by_model.setdefault(model, []).append(i)
        for model, members in by_model.items():
            direct = self.prefixes.direct_queues(model, [sends[i][2] or [] for i in members])
            for i, queue in zip(members, direct, strict=True):
                if queue is not None:
                    queues[i] = queue
        return queues

    def sample_prompt(self, model: str, request_id: str, input_ids: Sequence[int]) -> None:
        """While ``model`` has a canary, keep 1 in 20 requests' prompts for ``fleet models compare``'s
        shadow sample (one pipelined round trip for a sampled request; nothing otherwise)."""
        state = self.state(model)
        if state is not None and state.canary is not None and samples_prompt(request_id):
            record_recent_prompt(self.client, model, input_ids)
