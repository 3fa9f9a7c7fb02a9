"""What the fleet actually served: the stable versions workers loaded and put in service.

The desired state (:mod:`protocol.model_state`) says what *should* serve; this says what *did*. A
worker appends one :class:`Served` entry each time it puts a stable version in service (at start,
after a pin, a promote or a rollback). A worker that starts while the desired version cannot be
loaded (a corrupted or missing version is pinned) falls back to the newest entry here, the last
version the fleet served, instead of its configured one: otherwise stable traffic would split
between the configured version on the restarted worker and the last good one on the others.

Key (``model`` is the configured model key)::

    fleet:model-served:{model}   list, LPUSH of JSON Served (newest first, the last 20, expires after 30 days)
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import redis
from pydantic import BaseModel, ConfigDict

__all__ = ["SERVED_KEEP", "SERVED_KEY", "Served", "last_served", "read_served", "record_served"]

SERVED_KEY = "fleet:model-served:{model}"
SERVED_KEEP = 20
SERVED_TTL_S = 30 * 86_400


class Served(BaseModel):
    """One stable version a worker put in service."""

    model_config = ConfigDict(frozen=True)

    worker: str
    version: str
    """The version label the worker serves (what results and heartbeats name)."""
    store_version: str | None
    """The store version it was loaded as; None = the worker's configured model (its file or store_version)."""
    generation: int
    """The desired state's generation the worker had read when it loaded it (0 = no state)."""
    at_unix_s: float
    manifest_sha256: str | None = None
    """sha256 of the store manifest it loaded (None: a model file outside the store, or an entry an older worker
    wrote): a worker that falls back to this entry loads exactly these bytes or refuses."""


def record_served(
    r: redis.Redis[bytes], model: str, worker: str, version: str, store_version: str | None, generation: int,
    manifest_sha256: str | None = None,
) -> Served:
    """Append that ``worker`` serves ``version`` of ``model`` as stable (kept: the last 20, for 30 days), loaded
    from the manifest whose sha256 is ``manifest_sha256``."""
    served = Served(worker=worker, version=version, store_version=store_version, generation=generation,
                    at_unix_s=time.time(), manifest_sha256=manifest_sha256)
    key = SERVED_KEY.format(model=model)
    pipe = r.pipeline(transaction=False)
    pipe.lpush(key, served.model_dump_json())
    pipe.ltrim(key, 0, SERVED_KEEP - 1)
    pipe.expire(key, SERVED_TTL_S)
    pipe.execute()
    return served


def read_served(r: redis.Redis[bytes], model: str) -> list[Served]:
    """The model's served entries, newest first (unreadable entries skipped)."""
    out = []
    for raw in r.lrange(SERVED_KEY.format(model=model), 0, SERVED_KEEP - 1):
        try:
            out.append(Served.model_validate_json(raw))
        except ValueError:
            continue  # a foreign entry must not stop a worker from starting
    return out


def last_served(entries: Iterable[Served], *, other_than: Iterable[str | None] = ()) -> Served | None:
    """The newest entry whose ``store_version`` is not in ``other_than`` (the versions already refused), pure."""
    skip = set(other_than)
    return next((e for e in entries if e.store_version not in skip), None)
