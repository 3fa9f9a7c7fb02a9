"""A count the scheduler reads to decide, or 0 when it raises: the start-together wait's counts (requests on
their way to the scheduler, messages still waiting in Redis) must never end the scheduler's thread."""

from __future__ import annotations

import logging
from collections.abc import Callable

__all__ = ["CountOrZero"]

log = logging.getLogger("fleet.scheduler")


class CountOrZero:
    """A count the scheduler reads to decide (``count()``), or 0 when it raises: a failure must not end the
    scheduler's thread (every held request would wait for ever). A failure is logged once per failing
    stretch, not at every decision of it (``traceback``: with the exception's, for a count that should not
    fail), and the count answering again is logged too."""

    def __init__(self, count: Callable[[], int], what: str, meanwhile: str, *, traceback: bool = False) -> None:
        self._count = count
        self.what = what
        self.meanwhile = meanwhile
        """What a failure costs, for the log line."""
        self._traceback = traceback
        self.failing = False

    def __call__(self) -> int:
        try:
            count = self._count()
        except Exception as exc:
            if not self.failing:
                log.warning("%s failed (%s: %s); counted as 0 (%s) until it answers", self.what,
                            type(exc).__name__, exc, self.meanwhile, exc_info=self._traceback)  # fmt: skip
            self.failing = True
            return 0
        if self.failing:
            log.info("%s answers again", self.what)
            self.failing = False
        return count
