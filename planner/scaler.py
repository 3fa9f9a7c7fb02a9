"""KEDA + HPA, simplified: how many worker replicas a ScaledObject asks for, as a pure function of time.

What is modelled (one decision per ``polling_interval_s``; the clock is passed in):

- **Metrics.** The redis trigger's list length (requests waiting) against ``list_length`` per replica,
  and optionally the prometheus trigger's waiting + held requests against ``held_threshold`` per
  replica. KEDA exposes both to the HPA, which takes the larger replica count (``AverageValue``:
  ``ceil(metric / target)``).
- **Activation from zero.** At 0 replicas KEDA itself decides: a metric above its activation value
  (``activation_list_length``, 0 = one waiting request) scales to 1; the HPA takes over from the
  next poll.
- **Scale up.** The HPA's default policy: at most ``max(2 x current, current + 4)`` replicas per
  decision, within ``[max(min_replicas, 1), max_replicas]``.
- **Scale down.** The HPA's stabilization window: the largest recommendation of the last
  ``scale_down_stabilization_s`` (default 300 s, as in Kubernetes) wins.
- **Back to zero.** When no trigger has been active for ``cooldown_s``, KEDA scales to 0 if
  ``min_replicas`` is 0 or ``idle_replicas`` is 0; with ``idle_replicas`` 0 an activation goes
  straight to ``min_replicas`` (a warm floor while traffic flows, nothing while it does not).

Not modelled: the HPA's 10 % tolerance, its separate 15 s sync period (decisions follow KEDA's
polling interval), metric scrape lag of Prometheus, and pod scheduling beyond a fixed start time.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

__all__ = ["Autoscaler", "ScalerSettings"]


@dataclass(frozen=True)
class ScalerSettings:
    """The ScaledObject's numbers (names as in ``deploy/k8s/keda-worker-*.yaml``) and the pod start time."""

    min_replicas: int = 0
    """``minReplicaCount``: the floor while any trigger is active (0 lets the fleet scale to zero)."""
    idle_replicas: int | None = None
    """``idleReplicaCount`` (KEDA allows only 0): inactive for ``cooldown_s`` → this many, and on activation
    straight back to ``min_replicas``; None = not set."""
    max_replicas: int = 8
    """``maxReplicaCount``."""
    polling_interval_s: float = 5.0
    """``pollingInterval`` (s): how often KEDA reads the triggers."""
    cooldown_s: float = 300.0
    """``cooldownPeriod`` (s): inactive this long before scaling to ``min_replicas``."""
    list_length: int = 8
    """redis trigger ``listLength``: waiting requests per replica."""
    activation_list_length: int = 0
    """redis trigger ``activationListLength``: above this, a fleet at zero wakes up."""
    held_threshold: int | None = 12
    """prometheus trigger ``threshold``: waiting + held requests per replica (None: no such trigger)."""
    start_s: float = 30.0
    """Pod start to ready (s): image pull, model load, warm-up, TensorRT engine build."""
    scale_down_stabilization_s: float = 300.0
    """HPA ``behavior.scaleDown.stabilizationWindowSeconds`` (s)."""

    def __post_init__(self) -> None:
        if self.min_replicas < 0 or self.max_replicas < max(1, self.min_replicas):
            raise ValueError(f"need 0 <= min_replicas <= max_replicas and max_replicas >= 1, got "
                             f"min_replicas={self.min_replicas}, max_replicas={self.max_replicas}")
        if self.polling_interval_s <= 0 or self.list_length < 1:
            raise ValueError(f"polling_interval_s must be > 0 (got {self.polling_interval_s}) and list_length "
                             f">= 1 (got {self.list_length})")
        if self.cooldown_s < 0 or self.start_s < 0 or self.scale_down_stabilization_s < 0:
            raise ValueError("cooldown_s, start_s and scale_down_stabilization_s must be >= 0")
        if self.idle_replicas is not None and not 0 <= self.idle_replicas < self.min_replicas:
            raise ValueError(f"idle_replicas must be >= 0 and < min_replicas ({self.min_replicas}), "
                             f"got {self.idle_replicas}")
        if self.held_threshold is not None and self.held_threshold < 1:
            raise ValueError(f"held_threshold must be >= 1 or None, got {self.held_threshold}")


@dataclass
class Autoscaler:
    """Replica decisions for one ScaledObject; call :meth:`decide` every ``polling_interval_s``."""

    settings: ScalerSettings
    _last_active_s: float = 0.0
    """Last poll a trigger was active (s); the cooldown also counts from the start, as KEDA's does from creation."""
    _recommendations: deque[tuple[float, int]] = field(default_factory=deque)

    def _active(self, waiting: int, held: int) -> bool:
        s = self.settings
        return waiting > s.activation_list_length or (s.held_threshold is not None and waiting + held > 0)

    def _hpa(self, waiting: int, held: int) -> int:
        s = self.settings
        want = math.ceil(waiting / s.list_length)
        if s.held_threshold is not None:
            want = max(want, math.ceil((waiting + held) / s.held_threshold))
        return want

    def decide(self, now_s: float, current: int, waiting: int, held: int) -> int:
        """Replicas wanted at ``now_s`` (s) with ``current`` replicas, ``waiting`` queued and ``held`` taken."""
        s = self.settings
        if self._active(waiting, held):
            self._last_active_s = now_s
        can_sleep = s.min_replicas == 0 or s.idle_replicas == 0
        if current == 0:
            self._recommendations.clear()
            if self._active(waiting, held):
                return max(s.min_replicas, 1)
            return 0 if can_sleep else s.min_replicas
        if can_sleep and now_s - self._last_active_s >= s.cooldown_s:
            self._recommendations.clear()
            return 0
        floor = max(s.min_replicas, 1)
        raw = min(s.max_replicas, max(floor, self._hpa(waiting, held)))
        self._recommendations.append((now_s, raw))
        while self._recommendations and self._recommendations[0][0] < now_s - s.scale_down_stabilization_s:
            self._recommendations.popleft()
        if raw > current:
            return min(raw, max(2 * current, current + 4))
        return min(current, max(r for _, r in self._recommendations)) if raw < current else current
