"""Operator commands of the ``fleet`` CLI: ``api``, ``status``, ``probe``, ``flower``.

``producer.cli`` calls :func:`register` with its sub-parsers. Exit codes follow ``fleet``'s:
0 ok; 1 not ready / not alive; 2 bad settings.

``python -m producer.ops_cli <command>`` runs the same commands without loading the rest of the
CLI (about 0.3 s instead of 2 s: what an exec probe wants). Kubernetes probes::

    # gateway pod
    readinessProbe: {exec: {command: [python, -m, producer.ops_cli, probe, ready]}}
    livenessProbe:  {exec: {command: [python, -m, producer.ops_cli, probe, live]}}
    # worker pod, by its Celery hostname (fleet worker -n demo-lm@<pod name>)
    readinessProbe: {exec: {command: [sh, -c, "python -m producer.ops_cli probe ready --worker demo-lm@$HOSTNAME"]}}
    livenessProbe:  {exec: {command: [sh, -c, "python -m producer.ops_cli probe live --worker demo-lm@$HOSTNAME"]}}
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import redis

from producer import flower_config
from producer.cli_types import setting_type
from producer.flower_broker import flower_broker_env
from producer.status_table import _kv as _kv
from producer.status_table import format_status as format_status
from producer.worker_readiness import not_ready_reason as _not_ready_reason
from protocol.errors import ConfigError
from protocol.keys import WORKER_KEY_PREFIX
from protocol.redis_conn import describe_redis_error, sync_client
from protocol.settings import (
    ApiSettings,
    FleetSettings,
    FlowerSettings,
    load_settings,
    no_models_configured,
)

__all__ = ["format_status", "main", "register"]

PROBE_TIMEOUT_S = 2.0


def _settings(args: argparse.Namespace) -> FleetSettings:
    return load_settings(args.config)


def _redis(settings: FleetSettings) -> redis.Redis[bytes]:
    return sync_client(settings, socket_connect_timeout=PROBE_TIMEOUT_S, socket_timeout=PROBE_TIMEOUT_S)


# -- fleet api -------------------------------------------------------------------------------------
def cmd_api(args: argparse.Namespace) -> int:
    from gateway.app import serve

    settings = _settings(args)
    host = args.host or settings.api.host
    port = settings.api.port if args.port is None else args.port  # in range: setting_type
    if (taken := _bind_problem(host, port)) is not None:
        print(f"fleet: {_cannot_listen(host, port, taken, 'FLEET_API__PORT')}", file=sys.stderr)
        return 1
    from producer.redis_preflight import refuse_wrong_url  # here: `python -m producer.ops_cli probe` starts fast

    if (code := refuse_wrong_url(settings, "fleet api")) is not None:
        return code
    if not settings.api.api_keys and not _loopback_only(host):
        print(f"fleet: WARNING: the gateway listens on {host}:{port}, beyond this machine, with NO API KEY: anyone "
              "who reaches the port can submit, read and cancel requests. Set FLEET_API__API_KEYS='[\"a-long-random-"
              "key\"]' (api.api_keys), or keep it on 127.0.0.1 behind a proxy that authenticates", file=sys.stderr,
              flush=True)
    serve(
        settings,
        host=host,
        port=port,
        log_level=args.log_level,
        access_log=not args.no_access_log,
    )
    return 0


PORT_TAKEN = "the port is already in use"


def _bind_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on now (None when it can), checked as uvicorn will bind it."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        return f"{host!r} does not resolve ({exc.strerror or exc})"
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as exc:
            return PORT_TAKEN if exc.errno == errno.EADDRINUSE else str(exc.strerror or exc)
    return None


def _cannot_listen(host: str, port: int, problem: str, port_env: str) -> str:
    """The line for a server that cannot listen on ``host:port`` (``problem``: :func:`_bind_problem`), with the
    fix: another port when it is taken, else an address of this machine."""
    if problem == PORT_TAKEN:
        fix = f"stop what holds it, or choose another port with --port N ({port_env})"
    else:
        fix = "give --host an address of this machine (127.0.0.1; 0.0.0.0 = every interface)"
    return f"cannot listen on {host}:{port}: {problem}; {fix}"


def _loopback_only(host: str) -> bool:
    """Whether every address ``host`` names is a loopback one (``127.0.0.1``, ``::1``, ``localhost``): only
    this machine can connect. ``0.0.0.0``, ``::``, another interface's address or a name that does not resolve
    are not."""
    import ipaddress
    import socket

    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]).is_loopback for info in infos)


# -- fleet status ----------------------------------------------------------------------------------
def status_document(settings: FleetSettings, client: redis.Redis[bytes]) -> dict[str, Any]:
    """Workers and queues as one JSON-friendly document (what ``fleet status --json`` prints)."""
    from producer.registry import read_fleet_state, readiness_problems

    now_s = time.time()
    state = read_fleet_state(settings, client, now_s)
    workers = [
        {**w, "heartbeat_age_s": round(now_s - float(w.get("heartbeat_unix_s") or now_s), 3)} for w in state.workers
    ]
    queues = [
        {
            "model": m.name,
            "queue": m.queue,
            "depth": m.depth,
            "direct_depth": m.direct_depth,
            "max_queue_depth": m.max_queue_depth,
            "in_flight": m.in_flight,
            "ready_workers": m.ready_workers,
            "workers": len(m.workers),
            "oldest_waiting_s": None if m.oldest_waiting_s is None else round(m.oldest_waiting_s, 3),
            "drain_rate_per_s": round(m.drain_rate_per_s, 3),
        }
        for m in state.models
    ]
    from producer.model_status import model_states

    # Redis down: readiness_problems says so (URL masked); there are no version states to read
    models = [] if state.redis_error else model_states(settings, client, state.workers)  # one heartbeat reading
    return {"workers": workers, "queues": queues, "models": models, "problems": readiness_problems(state)}


def cmd_status(args: argparse.Namespace) -> int:
    settings = _settings(args)
    from producer.cli_errors import debug_enabled, redis_failure

    client = _redis(settings)
    try:
        try:
            client.ping()
            unreachable: redis.RedisError | None = None
        except redis.RedisError as exc:
            unreachable = exc
        doc = status_document(settings, client)
    finally:
        client.close()
    if unreachable is not None:  # Redis down or a wrong password: nothing to tabulate; one line and exit 1
        if args.json:
            print(json.dumps(doc))
        if debug_enabled(args):
            raise unreachable
        line, code = redis_failure(unreachable, settings.redis_url)
        print(f"fleet: {line}", file=sys.stderr)
        return code
    print(json.dumps(doc) if args.json else format_status(doc))
    if not settings.models:  # an empty QUEUES table, said: the wrong directory, or a config not given
        print(f"fleet: note: {no_models_configured(settings)}", file=sys.stderr)
    return 0


# -- fleet probe -----------------------------------------------------------------------------------
def probe(settings: FleetSettings, kind: str, *, worker: str | None, models: list[str] | None) -> list[str]:
    """Problems that fail the probe ([] = pass).

    ``live``: with ``worker``, that worker's heartbeat has not expired while Redis answers, and names no dead
    thread (a thread the worker needs that died is restarted by nothing: the process must be). A Redis that does not
    answer fails no liveness: it is not the probed process's fault, and a liveness probe that failed on it
    restarted every worker and gateway at once (into the same outage); readiness fails instead.
    ``ready``: Redis answers and each of ``models`` (default: all configured, and settings that configure none
    fail: :func:`no_models_configured`) has a ready worker (with ``worker``: that worker's heartbeat says ready).
    """
    from producer.registry import read_fleet_state, readiness_problems

    if kind == "ready" and worker is None and not models and not settings.models:
        return [no_models_configured(settings)]  # else "ok": every one of no models has a ready worker
    client = _redis(settings)
    try:
        client.ping()
        if worker is not None:
            raw = client.get(WORKER_KEY_PREFIX + worker)
            if raw is None:
                return [f"worker {worker!r} has no live heartbeat"]
            beat = json.loads(raw)
            if kind == "ready" and not beat.get("ready"):
                return [_not_ready_reason(worker, beat)]
            if kind == "live" and beat.get("dead_threads"):  # nothing restarts them: the process must be
                return [f"worker {worker!r} beats but cannot recover: thread {', '.join(beat['dead_threads'])} "
                        "died (its exception is in the worker's log); restart it"]  # fmt: skip
            return []
        if kind == "live":
            if not settings.models:  # said, as a Redis outage is: restarting the process would not configure one
                print(f"fleet probe live: note: {no_models_configured(settings)}: a reason to be not ready, not to "
                      "be restarted", file=sys.stderr)
            return []
        keys = [settings.model_key(m) for m in models] if models else None
        return readiness_problems(read_fleet_state(settings, client), keys)
    except redis.RedisError as exc:
        if kind == "live" and isinstance(exc, redis.ConnectionError | redis.TimeoutError):
            print(f"fleet probe live: note: {describe_redis_error(exc, settings)}: a reason to be not ready, not to "
                  "be restarted", file=sys.stderr)
            return []
        return [describe_redis_error(exc, settings)]
    finally:
        client.close()


def cmd_probe(args: argparse.Namespace) -> int:
    problems = probe(_settings(args), args.kind, worker=args.worker, models=args.model)
    if problems:
        print(f"fleet probe {args.kind}: FAIL: " + "; ".join(problems), file=sys.stderr)
        return 1
    print(f"fleet probe {args.kind}: ok")
    return 0


# -- fleet flower ----------------------------------------------------------------------------------
FLOWER_TASKS_COLUMNS = ("uuid", "state", "args", "result", "worker", "routing_key", "runtime", "received", "exception")
"""The Tasks page's columns (Flower's ``--tasks_columns`` slugs): request ID, state, request JSON,
result JSON, the worker, the queue, seconds it ran, when a worker received it, the error (last: it
is the one column Flower does not cap in width)."""
FLOWER_DB = Path("var/flower/flower.db")
"""Where Flower keeps the tasks and workers it saw (``--persistent``), relative to the working directory."""
FLOWER_STATE_SAVE_INTERVAL_MS = 10_000
"""How often Flower saves that state besides at a clean stop (``--state_save_interval``, ms)."""


def flower_command(
    settings: FleetSettings, host: str | None, port: int | None, db: Path = FLOWER_DB
) -> tuple[list[str], dict[str, str]]:
    """The Flower command line and its environment.

    The basic-auth users and the broker URL (which may hold a password) travel in the environment,
    not in ``ps``. Flower shows :data:`FLOWER_TASKS_COLUMNS`, formats args and results as JSON
    (``--conf`` :mod:`producer.flower_config`) and keeps what it saw in ``db`` across restarts.

    Raises:
        ConfigError: ``flower.basic_auth`` is empty: Flower never runs without auth.
    """
    if not settings.flower.basic_auth:
        raise ConfigError(
            "Flower needs basic auth: set flower.basic_auth (FLEET_FLOWER__BASIC_AUTH='[\"user:password\"]')",
            "flower.basic_auth",
            "at least one user:password",
        )
    cmd = [
        sys.executable,
        "-m",
        "producer.flower_main",  # celery flower, with a SIGTERM that always stops it
        "flower",
        f"--address={host or settings.flower.host}",
        f"--port={settings.flower.port if port is None else port}",
        f"--conf={Path(flower_config.__file__).resolve()}",
        f"--tasks_columns={','.join(FLOWER_TASKS_COLUMNS)}",
        "--persistent=True",
        f"--db={db.resolve()}",
        f"--state_save_interval={FLOWER_STATE_SAVE_INTERVAL_MS}",
    ]
    env = {
        **os.environ,
        **flower_broker_env(settings),  # the URL (maybe with a password), TLS options, Sentinel master
        "FLOWER_BASIC_AUTH": ",".join(settings.flower.basic_auth),
    }
    return cmd, env


def cmd_flower(args: argparse.Namespace) -> int:
    settings = _settings(args)
    cmd, env = flower_command(settings, args.host, args.port, args.db)
    host = args.host or settings.flower.host
    port = settings.flower.port if args.port is None else args.port
    if (taken := _bind_problem(host, port)) is not None:  # else Tornado's traceback, after Flower's start-up
        print(f"fleet: {_cannot_listen(host, port, taken, 'FLEET_FLOWER__PORT')}", file=sys.stderr)
        return 1
    from producer.redis_preflight import refuse_wrong_url

    if (code := refuse_wrong_url(settings, "fleet flower")) is not None:  # else kombu's retry loop in Flower
        return code
    args.db.resolve().parent.mkdir(parents=True, exist_ok=True)
    os.execvpe(cmd[0], cmd, env)
    return 0  # pragma: no cover - execvpe does not return


# -- registration ----------------------------------------------------------------------------------
def register(sub: Any) -> None:
    """Add ``api``, ``status``, ``probe`` and ``flower`` to the ``fleet`` sub-parsers."""

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", default=None, help="YAML settings (default: $FLEET_CONFIG or configs/fleet.yaml)")

    p = sub.add_parser("api", help="run the HTTP gateway (FastAPI + uvicorn)")
    common(p)
    p.add_argument("--host", default=None, help="bind address (default: settings api.host)")
    p.add_argument("--port", type=setting_type(ApiSettings, "api.port"), default=None,
                   help="port, 1..65535 (default: settings api.port)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default: info)")
    p.add_argument("--no-access-log", action="store_true", help="do not log every HTTP request")
    p.set_defaults(func=cmd_api)

    p = sub.add_parser("status", help="print workers and queues (depth, in-flight, ready, oldest waiting)")
    common(p)
    p.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("probe", help="Kubernetes probe: exit 0 when ready/alive, 1 when not")
    common(p)
    p.add_argument("kind", choices=["ready", "live"],
                   help="ready: the fleet (or --worker) takes work; live: the process is alive (restart it if not)")
    p.add_argument("--worker", default=None, help="check this worker's heartbeat (its Celery hostname)")
    p.add_argument("--model", action="append", default=None, help="ready: only these models need a worker (repeatable)")
    p.set_defaults(func=cmd_probe)

    p = sub.add_parser("flower", help="run Flower on the fleet's Redis, with basic auth from settings")
    common(p)
    p.add_argument("--host", default=None, help="bind address (default: settings flower.host)")
    p.add_argument("--port", type=setting_type(FlowerSettings, "flower.port"), default=None,
                   help="port, 1..65535 (default: settings flower.port)")
    p.add_argument(
        "--db", type=Path, default=FLOWER_DB, help=f"file where Flower keeps what it saw (default: {FLOWER_DB})"
    )
    p.set_defaults(func=cmd_flower)


def main(argv: list[str] | None = None) -> int:
    """``python -m producer.ops_cli``: the operator commands alone (fast start for probes)."""
    from producer.cli_errors import run_command

    parser = argparse.ArgumentParser(prog="fleet", description="onnx-fleet operator commands")
    parser.add_argument("--debug", action="store_true", help="show the traceback of a failure (also FLEET_DEBUG=1)")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return run_command(args.func, args)


if __name__ == "__main__":
    raise SystemExit(main())
