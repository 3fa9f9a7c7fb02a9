"""Which role's queue a request goes to (pure: no I/O): the canary when one is set and the sticky
fraction of the request's routing key is below ``canary_weight / 100``, else the stable one.
"""

from __future__ import annotations

from hashlib import sha256

from protocol.model_records import ModelState, Role

__all__ = ["route", "routing_fraction"]


def routing_fraction(key: str) -> float:
    """A fixed fraction in [0, 1) for ``key``: the first 8 bytes of its sha256 over 2**64.

    Never raises: a key that is not valid UTF-8 text (a lone surrogate, which JSON can carry) is hashed as
    its ``surrogatepass`` bytes, so it still routes the same way every time."""
    return int.from_bytes(sha256(key.encode("utf-8", "surrogatepass")).digest()[:8], "big") / 2**64


def route(state: ModelState | None, key: str) -> Role:
    """``canary`` when a canary is set and ``key``'s fraction is below its weight, else ``stable``."""
    if state is None or state.canary is None or state.canary_weight <= 0:
        return "stable"
    return "canary" if routing_fraction(key) < state.canary_weight / 100 else "stable"

