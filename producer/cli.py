"""The ``fleet`` command line. Every command that returns data prints JSON on stdout.

Exit codes: 0 ok; 1 the request failed, timed out or is unknown, Redis unreachable or refused the
credentials; 2 bad input or settings (nothing queued); 3 a worker could not start; 130 interrupted; 141 stdout
closed early (nothing said). A failure prints one
line that names the cause and the fix, without a traceback unless ``fleet --debug``
(:mod:`producer.cli_errors`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]


def _print(doc: Any) -> None:
    print(json.dumps(doc, indent=None, sort_keys=False))


def _client(args: argparse.Namespace) -> Any:
    from producer.client import FleetClient

    return FleetClient.from_settings(args.config)


def cmd_submit(args: argparse.Namespace) -> int:
    from producer.cli_generation import generation_from_args, parse_ids, print_stream
    from producer.results import RequestStatus

    client = _client(args)
    ids = parse_ids(args.tokens, "--tokens", "input_ids") if args.tokens is not None else None
    rid = client.submit(
        args.model,
        ids,
        text=args.text,
        request_id=args.request_id,
        top_k=args.top_k,
        deadline_s=args.deadline_s,
        generation=generation_from_args(args),
        routing_key=args.routing_key,
    )
    status = client.status(rid)  # a resubmitted ID may have ended already: no worker is then awaited
    warning = _no_worker(client, args.model) if status is RequestStatus.QUEUED else None
    if warning:  # accepted all the same: a fleet scaled to zero starts on its queue
        print(f"fleet: warning: {warning}", file=sys.stderr, flush=True)
    if generation_from_args(args) is not None and (note := _random_weights_note(client, args.model)):
        print(f"fleet: note: {note}", file=sys.stderr, flush=True)
    if args.stream:
        return print_stream(client, rid, args.timeout)
    if not args.wait:
        _print({"request_id": rid, "status": status.value} | ({"warning": warning} if warning else {}))
        return 0
    result = _wait_naming_the_worker(client, rid, args.model, args.timeout)
    _print(result.model_dump(mode="json") if result else {"request_id": rid})
    return 0


def _random_weights_note(client: Any, model: str) -> str | None:
    """Said before a generation's text is printed when the model was built from seeded random weights
    (``fleet build-model``: its card records the seed): that text is noise, not a fault."""
    card = client._model(model)[1].card
    if card is None or card.seed is None:
        return None
    return (f"{card.name} has random weights (seed {card.seed}, built by `fleet build-model`): the text it "
            "generates is noise; the fleet's work around it is what a demo shows")


def _no_worker(client: Any, model: str) -> str | None:
    """The no-live-worker warning for ``model`` (None when a worker's heartbeat is live)."""
    from producer.presence import has_live_worker, no_worker_message

    key = client.settings.model_key(model)
    return None if has_live_worker(client.redis, key) else no_worker_message(key, client.settings.queue_for(key))


def _wait_naming_the_worker(client: Any, rid: str, model: str | None, timeout_s: float) -> Any:
    """``client.result(wait=True)``; a timeout says so when no worker serves the model at the end.

    Raises:
        RequestFailed: the request failed (:func:`_stored_result`).
        ResultTimeout: no result within ``timeout_s``.
    """
    from protocol.errors import ResultTimeout

    try:
        return _stored_result(client, rid, wait=True, timeout_s=timeout_s)
    except ResultTimeout as exc:
        warning = _no_worker(client, model) if model else None
        if warning is None:
            raise
        raise ResultTimeout(f"no result for {rid} within {timeout_s} s: {warning}", exc.field, exc.limit) from exc


def _stored_result(client: Any, rid: str, *, wait: bool, timeout_s: float | None = None) -> Any:
    """``client.result(rid)``, where a failure read back from the result store (the request was queued, then
    failed) becomes :class:`producer.cli_errors.RequestFailed` (exit 1), even a worker's InvalidRequest.

    Raises:
        RequestFailed: the request failed; ``exc.error`` is the worker's error.
        ResultTimeout, RequestNotFound: raised by the wait or the look-up itself, not stored.
    """
    from producer.cli_errors import RequestFailed
    from protocol.errors import FleetError, RequestNotFound, ResultTimeout

    try:
        return client.result(rid, wait=wait, timeout_s=timeout_s)
    except (ResultTimeout, RequestNotFound):
        raise
    except FleetError as exc:  # everything else client.result raises is the stored outcome
        raise RequestFailed(exc) from exc


def cmd_result(args: argparse.Namespace) -> int:
    from producer.presence import marker_key, request_model
    from producer.results import RequestStatus
    from protocol.errors import RequestNotFound

    client = _client(args)
    rid = args.request_id
    status = client.status(rid)
    if status is RequestStatus.NOT_FOUND:  # waiting for an ID nobody submitted would only run out the clock
        raise RequestNotFound(f"no request {rid!r} is known: never submitted through the fleet, or its result "
                              "expired (result_ttl_s); check the ID that `fleet submit` printed", "request_id", None)
    model = request_model(client.redis.get(marker_key(rid)))
    warning = _no_worker(client, model) if model and status is RequestStatus.QUEUED else None
    if warning:
        print(f"fleet: warning: {warning}", file=sys.stderr, flush=True)
    result = (_wait_naming_the_worker(client, rid, model, args.timeout) if args.wait
              else _stored_result(client, rid, wait=False))
    if result is None:
        _print({"request_id": rid, "status": status.value} | ({"warning": warning} if warning else {}))
        return 0
    _print(result.model_dump(mode="json"))
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    from producer.results import CANCEL_SETTLE_S, RequestStatus
    from protocol.errors import RequestNotFound

    client = _client(args)
    if client.status(args.request_id) is RequestStatus.NOT_FOUND:  # else a cancel mark for an ID nobody sent
        raise RequestNotFound(f"no request {args.request_id!r} is known: never submitted through the fleet, or "
                              "its result expired (result_ttl_s); check the ID that `fleet submit` printed",
                              "request_id", None)
    ok = client.cancel(args.request_id, settle_s=CANCEL_SETTLE_S)
    status = client.status(args.request_id).value
    _print({"request_id": args.request_id, "cancelled": ok, "status": status})
    if not ok:  # exit 1 says "not cancelled"; the line says why, as every other exit 1 does
        why = "it is running and cannot be stopped mid-step" if status == "running" else f"it already ended ({status})"
        print(f"fleet: request {args.request_id!r} was not cancelled: {why}", file=sys.stderr, flush=True)
    return 0 if ok else 1


def cmd_worker(args: argparse.Namespace) -> int:
    from producer.worker_celery_args import celery_args
    from protocol.settings import load_settings
    from tools.processes import worker_command

    passed = celery_args(args.celery_args)  # an option the fleet sets itself is refused before anything runs

    env_updates = {}
    if args.model:
        env_updates["FLEET_WORKER__MODEL"] = args.model
    if args.concurrency is not None:
        env_updates["FLEET_WORKER__CONCURRENCY"] = str(args.concurrency)
    os.environ.update(env_updates)
    settings = load_settings(args.config)
    if args.config:
        os.environ["FLEET_CONFIG"] = str(args.config)
    model = settings.model_key(settings.worker.model)
    from producer.redis_preflight import mark_checked, preflight

    checked = preflight(settings, "fleet worker")
    if checked.exit_code is not None:  # else Celery's retry loop, forever
        return checked.exit_code
    mark_checked()  # Celery, exec'd below in this process, does not check (and warn) a second time
    # Redis did not answer: no second try to read the live names (Celery's default name; the worker checks again)
    hostname = args.hostname or (_free_default_name(settings, model) if checked.answered else f"{model}@%h")
    loglevel = args.loglevel or settings.worker.loglevel
    cmd = worker_command(model, settings.worker.concurrency, hostname, settings.queue_for(model), loglevel)
    os.execvp(cmd[0], [*cmd, *passed])
    return 0  # pragma: no cover - execvp does not return


def _free_default_name(settings: Any, model: str) -> str:
    """``<model>@<host>``, or ``<model>-2@<host>``, … when a live worker already holds it (two on one host:
    :mod:`workers.namesakes`); Celery's ``<model>@%h`` when Redis does not answer (the worker checks again)."""
    import socket

    import redis

    from protocol.redis_conn import sync_client
    from workers.namesakes import free_worker_name

    client = sync_client(settings, socket_timeout=2, socket_connect_timeout=2)
    try:
        name = free_worker_name(client, model, socket.gethostname())
    except redis.RedisError:
        return f"{model}@%h"
    finally:
        client.close()
    if not name.startswith(f"{model}@"):
        print(f"fleet worker: {model}@{socket.gethostname()} is running; this worker is {name}", file=sys.stderr)
    return name


def cmd_build_model(args: argparse.Namespace) -> int:
    from tools.build_model import run_build_model

    run_build_model(args)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from producer.demo import run_demo

    return run_demo(args)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", default=None, help="YAML settings file (default: $FLEET_CONFIG or configs/fleet.yaml)"
    )


def fleet_version() -> str:
    """The installed distribution's version (``pyproject.toml``'s), or ``unknown`` when not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("onnx-fleet")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    """The ``fleet`` argument parser (sub-commands register here)."""
    from producer.worker_celery_args import PassThroughParser

    parser = PassThroughParser(prog="fleet", description="onnx-fleet: queue-based ONNX Runtime inference.")
    parser.add_argument("--version", action="version", version=f"%(prog)s (onnx-fleet) {fleet_version()}",
                        help="print the installed onnx-fleet version and exit")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of a failure (also FLEET_DEBUG=1); without it, one line says "
                             "what failed and how to fix it")
    sub = parser.add_subparsers(dest="command", required=True)
    from producer.cli_types import number_in, setting_type
    from protocol.settings import WorkerSettings

    wait_seconds = number_in(float, 0, 86_400, "must be a number of seconds from 0 to 86400")

    p = sub.add_parser("submit", help="queue one request; prints its ID (or the result with --wait)")
    _add_common(p)
    p.add_argument("--model", required=True, help="the model to run it on (a name in settings models, e.g. demo-lm)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokens", help="comma-separated token ids, e.g. 5,6,7")
    src.add_argument("--text", help="text, tokenized here with the model's tokenizer")
    p.add_argument("--top-k", type=int, default=None,
                   help="next-token candidates returned (default 5; next-token requests only)")
    p.add_argument("--request-id", default=None, help="caller-given ID (idempotent submit)")
    p.add_argument("--routing-key", default=None,
                   help="sticky key for a canary split (e.g. a session ID; default: the request ID)")
    p.add_argument(
        "--deadline-s", type=float, default=None, help="drop the request if not run within S seconds"
    )
    p.add_argument("--wait", action="store_true", help="wait for the result and print it")
    p.add_argument("--timeout", type=wait_seconds, default=60.0, help="seconds to wait with --wait (default 60)")
    from producer.cli_generation import add_generation_args

    add_generation_args(p)
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("result", help="print a request's result (or its status)")
    _add_common(p)
    p.add_argument("request_id", help="the ID submit printed (or the request_id the caller gave)")
    p.add_argument("--wait", action="store_true",
                   help="wait for the outcome (up to --timeout) instead of printing the status now")
    p.add_argument("--timeout", type=wait_seconds, default=60.0, help="seconds to wait with --wait (default 60)")
    p.set_defaults(func=cmd_result)

    p = sub.add_parser("cancel", help="cancel a queued request, or stop a running generation within a step "
                      "(exit 1: it already ended, or is a one-step request already running)")
    _add_common(p)
    p.add_argument("request_id", help="the ID submit printed (or the request_id the caller gave)")
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser(
        "worker", help="run a Celery worker for one model (extra args go to celery)",
        description="Run a Celery worker for one model. Any option not listed here goes to `celery worker` in the "
        "order given (e.g. --logfile F, -O fair, --max-tasks-per-child N), and everything after --. Refused, as the "
        "fleet sets them itself: -P/--pool, -Q/--queues, -X/--exclude-queues, --autoscale, and -c/--concurrency "
        "after -- (give --concurrency to fleet worker).",
    )
    _add_common(p)
    p.add_argument("--model", default=None, help="model to serve (default: settings worker.model)")
    p.add_argument("--concurrency", "-c", type=setting_type(WorkerSettings, "worker.concurrency"), default=None,
                   help="token bucket C, 1..4096 (>= max_batch_size; default: settings worker.concurrency)")
    p.add_argument("--hostname", "-n", default=None,
                   help="Celery node name (default: <model>@<host>, or <model>-N@<host> when that name is live)")
    p.add_argument("--loglevel", "-l", default=None, type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="Celery's and the worker's log level (default: worker.loglevel, FLEET_WORKER__LOGLEVEL: INFO)")
    p.passes_unknown_to = "celery_args"  # a PassThroughParser, as its parent
    p.set_defaults(func=cmd_worker, celery_args=[])

    p = sub.add_parser("build-model", help="build the demo/bench ONNX models from seeded numpy weights")
    from tools.build_model import add_build_model_arguments

    add_build_model_arguments(p)
    p.set_defaults(func=cmd_build_model)

    p = sub.add_parser("demo", help="run the whole fleet end to end on a private Redis, then shut down")
    _add_common(p)
    p.add_argument("--requests", type=int, default=64, help="requests to submit (default 64)")
    p.add_argument("--concurrency", type=setting_type(WorkerSettings, "worker.concurrency"), default=16,
                   help="worker tokens C, 1..4096 (default 16)")
    p.add_argument("--no-flower", action="store_true", help="do not start Flower")
    p.add_argument("--keep-running", action="store_true", help="leave the fleet up until Ctrl-C")
    p.add_argument("--versions", action="store_true",
                   help="also publish demo-lm twice to an embedded S3 store (SeaweedFS), pin, canary 50 %%, "
                        "roll back, and show which version computed each request")
    p.set_defaults(func=cmd_demo)

    from producer.redis_cli import register as register_redis

    register_redis(sub)  # fleet redis: producer/redis_cli.py

    _register_extensions(sub)
    return parser


def _register_extensions(sub: Any) -> None:
    """Commands that live in their own modules (gateway, status, bench, quantize) add themselves here."""
    import importlib

    for module_name in ("producer.ops_cli", "bench.cli", "tools.quantize_cli", "producer.deadletter_cli",
                        "producer.models_cli", "producer.soak_cli", "planner.cli", "bench.gpu_report"):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name in (module_name, module_name.partition(".")[0]):  # e.g. an install older than the package
                continue
            raise
        module.register(sub)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fleet`` console script (exit codes: :mod:`producer.cli_errors`)."""
    from producer.cli_errors import EXIT_INTERRUPTED, debug_enabled, run_command
    from tools.interrupts import forget_caught_interrupt, forget_lost_interrupts, note_lost_interrupts

    forget_lost_interrupts()  # a record is the command's own (main may run more than once in one process)
    note_lost_interrupts()
    try:  # building the parser imports every command's module: about a second in which Ctrl-C lands too
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:
        if debug_enabled(None) or "--debug" in (sys.argv[1:] if argv is None else argv):
            raise
        print("fleet: interrupted", file=sys.stderr)
        forget_caught_interrupt()
        return EXIT_INTERRUPTED
    return run_command(args.func, args)

if __name__ == "__main__":
    raise SystemExit(main())
