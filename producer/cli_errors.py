"""How the ``fleet`` CLI ends a command that failed: one line on stderr that names the cause and the fix,
a documented exit code, and no traceback unless ``--debug`` (or ``FLEET_DEBUG=1``).

Exit codes (every ``fleet`` command, ``python -m producer.ops_cli`` too):

* 0 ok;
* 1 the request failed (a queued request's stored error, whatever its type: :class:`RequestFailed`), timed
  out or is unknown; Redis unreachable or refused the credentials; a local
  server (``fleet redis``, ``fleet demo``) could not start (port taken, loopback down); not ready; a
  ``fleet models pin`` that no live worker serves after ``--wait-s`` (NOT SERVED; recorded all the same);
* 2 bad input or settings (a YAML error, an invalid value, a ``FLEET_*`` variable that is not the JSON its
  setting takes, an unknown model or a version the store does not publish, no model store, a model file or
  card that cannot be used, a Redis URL
  that is wrong where Redis or something else answers: no such database, not Redis at that port,
  ``rediss://`` to a Redis without TLS or to something that speaks neither TLS nor Redis): nothing done;
* 3 a worker could not start;
* 130 interrupted (Ctrl-C);
* 141 stdout closed early (``fleet status | head -1``): what a shell reports for a command SIGPIPE killed, and
  nothing printed (:func:`run_command`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

import redis
from kombu.exceptions import OperationalError as KombuOperationalError
from pydantic_settings import SettingsError

from protocol.errors import ConfigError, FleetError, InvalidRequest, ModelLoadError
from protocol.redis_conn import mask_url, passwords_in, redact
from protocol.settings_env import settings_env_problem
from tools.interrupts import (
    forget_caught_interrupt,
    forget_lost_interrupts,
    interrupt_was_lost,
    note_lost_interrupts,
)

__all__ = ["EXIT_BAD_INPUT", "EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_STDOUT_CLOSED", "RequestFailed",
           "debug_enabled", "redis_failure", "run_command"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
EXIT_STDOUT_CLOSED = 141
"""128 + SIGPIPE: a ``fleet`` whose reader closed its stdout ends as a command killed by SIGPIPE would."""

REDIS_UNREACHABLE_FIX = "start one with `fleet redis`, or set FLEET_REDIS_URL to a Redis that answers"
REDIS_CREDENTIALS_FIX = "check the user and password in FLEET_REDIS_URL (redis://USER:PASSWORD@host:port/db)"


class RequestFailed(Exception):
    """A request that was queued ended in ``error``, read back from the result store: exit 1 whatever the
    error's type. An InvalidRequest the worker raised (TokenOutOfRange, …) is no bad input of this command:
    the request was queued (exit 2 is for errors raised before anything was queued)."""

    def __init__(self, error: FleetError) -> None:
        super().__init__(str(error))
        self.error = error


def debug_enabled(args: argparse.Namespace | None = None) -> bool:
    """``--debug`` was given, or ``FLEET_DEBUG`` is set to something other than 0/empty."""
    return bool(getattr(args, "debug", False)) or os.environ.get("FLEET_DEBUG", "") not in ("", "0")


def _redis_url(args: argparse.Namespace) -> str:
    """The URL the command used: settings (environment + YAML), else the environment, else the default."""
    try:
        from protocol.settings import load_settings

        return load_settings(getattr(args, "config", None)).redis_url
    except (FleetError, OSError, ValueError):
        return os.environ.get("FLEET_REDIS_URL", "redis://127.0.0.1:6379/0")


def redis_failure(exc: BaseException, url: str) -> tuple[str, int]:
    """(one line for a Redis failure, its exit code): the masked URL, what Redis said (no password), the fix.

    Where the URL itself is wrong the exit code is 2 and the fix names the part of it to change: a database the
    server does not have, a port where something that is not Redis answers (``Protocol error``), and a
    ``rediss://`` URL whose TLS handshake fails or times out where a plain Redis answers, or where something
    answers in clear text that is not Redis (an HTTP port: the peer did not speak TLS); both checked with one
    ``PING`` on a fresh connection without TLS, only on this failure path. A TLS handshake that a TLS peer
    failed (a certificate not verified, none sent where the server asks for one) names the TLS settings.
    """
    text = redact(str(exc), *passwords_in(url)).strip().rstrip(".")
    lowered = text.lower()
    if isinstance(exc, redis.AuthenticationError) or any(
        word in lowered for word in ("wrongpass", "noauth", "invalid password", "invalid username-password",
                                     "authentication required")
    ):
        if not passwords_in(url) and ("noauth" in lowered or "authenticated" in lowered):  # it asks, none given
            return (f"Redis at {mask_url(url)} requires a password and FLEET_REDIS_URL gives none ({text}); "
                    f"{REDIS_CREDENTIALS_FIX}"), EXIT_FAILED  # fmt: skip
        return f"Redis at {mask_url(url)} refused the credentials: {text}; {REDIS_CREDENTIALS_FIX}", EXIT_FAILED
    if "db index is out of range" in lowered:  # it answers: the URL names a database it does not have
        return (f"Redis at {mask_url(url)} has no such database ({text}): the number after the last / in "
                "FLEET_REDIS_URL must be below the server's `databases` (16 by default)"), EXIT_BAD_INPUT
    where = _host_port(url)
    if isinstance(exc, redis.InvalidResponse) and where is not None:  # an HTTP server, a database, ...
        return (f"what answers at {where[0]}:{where[1]} is not Redis ({text}): check the host and port in "
                f"FLEET_REDIS_URL ({mask_url(url)})"), EXIT_BAD_INPUT
    answer = _plain_answer(*where) if url.startswith("rediss://") and where is not None else None
    if where is not None and answer is not None and answer.startswith((b"+PONG", b"-NOAUTH")):
        return (f"Redis at {mask_url(url)} does not speak TLS ({text}), but a plain Redis answers at "
                f"{where[0]}:{where[1]}: write redis:// instead of rediss:// in FLEET_REDIS_URL, or turn TLS on "
                "in that server"), EXIT_BAD_INPUT
    if where is not None and answer and not answer.startswith(_TLS_RECORDS):  # it answers in clear, not as Redis
        return (f"what answers at {where[0]}:{where[1]} did not speak TLS and is not Redis (the TLS handshake "
                f"failed: {text}; a plain PING got {_shown(answer)}): check the host and port in FLEET_REDIS_URL "
                f"({mask_url(url)})"), EXIT_BAD_INPUT
    if url.startswith("rediss://") and any(word in lowered for word in ("ssl", "certificate", "tls")):
        return (f"TLS to Redis at {mask_url(url)} failed: {text}: check redis.tls_ca_file, tls_cert_file and "
                "tls_key_file (FLEET_REDIS__TLS_*) or the ssl_* options of FLEET_REDIS_URL"), EXIT_BAD_INPUT
    return f"cannot reach Redis at {mask_url(url)}: {text}; {REDIS_UNREACHABLE_FIX}", EXIT_FAILED


PLAIN_PING_TIMEOUT_S = 1.0
"""How long :func:`_plain_answer` waits to connect and for the answer (s)."""
_TLS_RECORDS = (b"\x15", b"\x16")
"""First bytes of a TLS record (an alert, a handshake): a TLS server's answer to a plain ``PING``."""


def _host_port(url: str) -> tuple[str, int] | None:
    """``(host, port)`` of a ``redis://`` or ``rediss://`` URL (port 6379 when it has none); None for others."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss") or not parts.hostname:
            return None
        return parts.hostname, parts.port or 6379
    except ValueError:
        return None


def _plain_answer(host: str, port: int) -> bytes | None:
    """The first bytes ``host:port`` answers to a ``PING`` sent without TLS (None: no connection or no answer
    within :data:`PLAIN_PING_TIMEOUT_S`), asked only after a ``rediss://`` URL failed there. ``+PONG`` (or
    ``-NOAUTH`` where it wants a password) is a plain Redis; other clear text (an HTTP server's error page) is
    something that speaks neither TLS nor Redis. The blank line after ``PING`` ends an HTTP request head, so an
    HTTP server answers at once; Redis skips it."""
    import socket

    try:
        with socket.create_connection((host, port), timeout=PLAIN_PING_TIMEOUT_S) as sock:
            sock.sendall(b"PING\r\n\r\n")
            return sock.recv(64) or None
    except OSError:
        return None


def _shown(answer: bytes) -> str:
    """The first line of a peer's answer, quoted, for the message (at most 40 characters)."""
    first = answer.split(b"\n", 1)[0].strip()
    return repr(first[:40].decode("ascii", "replace"))


def _is_redis_failure(exc: BaseException) -> bool:
    if isinstance(exc, redis.ConnectionError | redis.TimeoutError | redis.AuthenticationError | redis.InvalidResponse
                  | KombuOperationalError):
        return True
    # a wrong password on a server without ACL users, or a database it does not have, answer as plain error replies
    return isinstance(exc, redis.ResponseError) and any(
        w in str(exc) for w in ("WRONGPASS", "NOAUTH", "DB index is out of range")
    )


STORE_DOWN_FIX = ("; is the store running? start one with `fleet store` (it prints the FLEET_STORE__* exports), "
                  "or check FLEET_STORE__ENDPOINT_URL")


def _store_fix(exc: FleetError) -> str:
    """The fix for a model store that does not answer (boto3's "Could not connect to the endpoint URL")."""
    text = str(exc).lower()
    unreachable = ("could not connect", "connection refused", "connect timeout", "endpoint url")
    return STORE_DOWN_FIX if type(exc).__name__ == "StoreError" and any(w in text for w in unreachable) else ""


def _describe(exc: BaseException, args: argparse.Namespace) -> tuple[str, int, bool]:
    """(the line, the exit code, whether the error's JSON payload goes to stdout)."""
    from tools.redis_server import LoopbackDown, PortInUse

    if isinstance(exc, RequestFailed):
        return str(exc), EXIT_FAILED, True
    if isinstance(exc, InvalidRequest):
        return str(exc), EXIT_BAD_INPUT, True
    if isinstance(exc, ConfigError):
        return str(exc), EXIT_BAD_INPUT, False
    if type(exc).__name__ == "VersionNotFound":  # a version no push published, as an unknown model: nothing done
        return str(exc), EXIT_BAD_INPUT, True
    if isinstance(exc, SettingsError):  # a FLEET_* variable pydantic-settings could not read, e.g. a JSON list
        return settings_env_problem(exc)[0], EXIT_BAD_INPUT, False
    if type(exc) is ModelLoadError:  # a model file, card or tokenizer here that cannot be used; its subclasses
        return str(exc), EXIT_BAD_INPUT, True  # (a fetch's ChecksumMismatch) are failures of the command: exit 1
    if isinstance(exc, FleetError):
        return str(exc) + _store_fix(exc), EXIT_FAILED, True
    if _is_redis_failure(exc):
        return *redis_failure(exc, _redis_url(args)), False
    if isinstance(exc, PortInUse):
        return f"{exc}; choose another with --port N (0 = a free one), or stop what holds it", EXIT_FAILED, False
    if isinstance(exc, LoopbackDown):
        return str(exc), EXIT_FAILED, False
    if isinstance(exc, OSError) and exc.filename:  # a path the caller gave: missing, not a folder, not writable…
        return _path_problem(exc), EXIT_BAD_INPUT, False
    return (f"unexpected {type(exc).__name__}: {redact(str(exc), *passwords_in(_redis_url(args)))} "
            "(run again with `fleet --debug ...` for the traceback)"), EXIT_FAILED, False


def _path_problem(exc: OSError) -> str:
    """``<path>: <what the system said>``, and where the path is a model that is not there, how to make one."""
    line = f"{exc.filename}: {(exc.strerror or 'no such file').lower()}"
    if isinstance(exc, FileNotFoundError) and str(exc.filename).endswith((".onnx", ".json")):
        line += " (check the path, or build the models: `fleet build-model`)"
    return line


def stdout_closed() -> bool:
    """Whether nothing reads ``sys.stdout`` any more (a pipe whose reader exited: ``fleet status | head -1``).

    Asked of the file itself (``poll``: an error on the write end), so that a BrokenPipeError from another pipe
    (a child process's stdin) is still reported as a failure."""
    import select

    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by an object without a file (a test's capture)
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def silence_stdout() -> None:
    """Point ``sys.stdout``'s file at ``/dev/null``: what is still buffered, flushed at exit, goes nowhere instead
    of raising a second BrokenPipeError (the Python docs' recipe, "Note on SIGPIPE" in :mod:`signal`)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)


def _print_payload(line: str) -> None:
    """A failure's JSON line on stdout; where nobody reads it any more, only the failure's line (stderr) is said."""
    try:
        print(line, flush=True)
    except BrokenPipeError:
        if not stdout_closed():
            raise
        silence_stdout()


def run_command(func: Callable[[argparse.Namespace], int | None], args: argparse.Namespace) -> int:
    """Run a sub-command's function; a failure becomes ``fleet: <one line>`` on stderr and its exit code.

    With ``--debug`` the exception propagates (Python prints its traceback). A Ctrl-C ends the command
    with 130 and ``fleet: interrupted`` also where CPython mishandles it (:mod:`tools.interrupts`): one
    that landed in a finalizer (no traceback; a command that ran to its end after it is reported
    interrupted, unless it handled the stop itself), one that left a string ``exec`` (no death by SIGINT).
    A stdout whose reader went away (``fleet status | true``) ends it with 141 and no message, ``--debug`` too.
    """
    note_lost_interrupts()
    try:
        code = int(func(args) or 0)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit ("Exception ignored … BrokenPipeError")
        if interrupt_was_lost():
            print("fleet: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        return code
    except KeyboardInterrupt:
        if debug_enabled(args):
            raise
        print("fleet: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        if isinstance(exc, BrokenPipeError) and stdout_closed():  # not a failure: the reader had enough
            silence_stdout()
            return EXIT_STDOUT_CLOSED
        if debug_enabled(args):
            raise
        line, code, payload = _describe(exc, args)
        error = exc.error if isinstance(exc, RequestFailed) else exc
        if payload and isinstance(error, FleetError):
            _print_payload(json.dumps(error.to_payload()))
        print(f"fleet: {line}", file=sys.stderr)
        return code
    finally:
        forget_lost_interrupts()
        forget_caught_interrupt()
