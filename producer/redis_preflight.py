"""The Redis URL checked before a long-running process starts on it: one ``PING``, and a wrong URL stops it.

``fleet submit``, ``status``, ``result``, ``cancel``, ``dead-letter``, ``models`` … meet a wrong Redis URL on
their first command, and :func:`producer.cli_errors.redis_failure` turns the error into one line. The commands
that hand the process over to something else never got that far: ``fleet worker`` (Celery, whose consumer
retries a URL that can never work, forever), ``fleet flower`` (Flower, the same through kombu) and ``fleet api``
(uvicorn, whose gateway answered every request 503). They call :func:`refuse_wrong_url` first; so does a bare
``celery -A workers.app worker`` (at ``worker_init``, before the model loads).

Once per process: ``fleet worker`` checks, then becomes Celery in the same process (``exec``: the same pid), whose
``worker_init`` would check again (a second ``PING``, up to :data:`PREFLIGHT_TIMEOUT_S` more, and a second
warning when Redis is down). :func:`mark_checked` records the check in the environment under this pid and
:func:`checked_already` at ``worker_init`` takes it: only the process that checked skips, never a child or a later
process that inherited the variable.

What stops the process (one ``fleet:`` line, the code :func:`~producer.cli_errors.redis_failure` gives):
a URL that is wrong where something answers (exit 2: not Redis at that port, ``rediss://`` to a plain Redis
or to something that speaks neither TLS nor Redis, no such database) and credentials Redis refuses (exit 1).
A Redis that does not answer at all only warns: it may be starting (a compose file or a pod that starts the
worker first), and the worker's reconnection covers that.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import redis

from producer.cli_errors import redis_failure
from protocol.redis_conn import sync_client
from protocol.settings import FleetSettings

__all__ = ["CHECKED_ENV", "PREFLIGHT_TIMEOUT_S", "Preflight", "checked_already", "mark_checked", "preflight",
           "redis_problem", "refuse_wrong_url"]

PREFLIGHT_TIMEOUT_S = 2.0
"""How long the ``PING`` waits to connect and for its answer (s)."""

UNREACHABLE = "cannot reach Redis"
"""How :func:`~producer.cli_errors.redis_failure`'s line starts when nothing answered: a warning, not a stop."""
CHECKED_ENV = "FLEET_REDIS_PREFLIGHT_PID"
"""Environment variable holding the pid of the process whose Redis URL was checked (:func:`mark_checked`)."""


@dataclass(frozen=True)
class Preflight:
    """What :func:`preflight` found: ``exit_code`` to stop with (None: go on); ``answered``: Redis answered
    ``PING`` (False also when it stopped or only warned)."""

    exit_code: int | None
    answered: bool


def redis_problem(settings: FleetSettings) -> tuple[str, int] | None:
    """``(one line, exit code)`` for a Redis URL that does not answer ``PING`` (None: it does).

    One fresh connection with :data:`PREFLIGHT_TIMEOUT_S` timeouts, closed after; the line is
    :func:`~producer.cli_errors.redis_failure`'s (the URL masked, no password).
    """
    client = sync_client(settings, socket_connect_timeout=PREFLIGHT_TIMEOUT_S, socket_timeout=PREFLIGHT_TIMEOUT_S)
    try:
        client.ping()
    except redis.RedisError as exc:
        return redis_failure(exc, settings.redis_url)
    finally:
        client.close()
    return None


def preflight(settings: FleetSettings, command: str) -> Preflight:
    """Check the Redis URL before ``command`` (``"fleet worker"``) starts, as :func:`refuse_wrong_url` does, and
    say whether Redis answered (a caller may skip its own Redis reads when it did not)."""
    problem = redis_problem(settings)
    if problem is None:
        return Preflight(exit_code=None, answered=True)
    line, code = problem
    if line.startswith(UNREACHABLE):
        print(f"{command}: warning: {line}; starting anyway (it retries until Redis answers)", file=sys.stderr,
              flush=True)
        return Preflight(exit_code=None, answered=False)
    print(f"fleet: {line}", file=sys.stderr, flush=True)
    return Preflight(exit_code=code, answered=False)


def refuse_wrong_url(settings: FleetSettings, command: str) -> int | None:
    """Check the Redis URL before ``command`` (``"fleet worker"``) starts: the exit code to stop with (its line
    printed on stderr as ``fleet: …``), or None to go on (Redis answered, or nothing answered: then
    ``<command>: warning: …`` is printed and the process starts and retries)."""
    return preflight(settings, command).exit_code


def mark_checked() -> None:
    """Record that this process checked its Redis URL, for :func:`checked_already` after an ``exec``."""
    os.environ[CHECKED_ENV] = str(os.getpid())


def checked_already() -> bool:
    """Whether this very process checked its Redis URL before an ``exec`` (:func:`mark_checked`). The record is
    removed, so the processes this one starts check for themselves."""
    return os.environ.pop(CHECKED_ENV, None) == str(os.getpid())
