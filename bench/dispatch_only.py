"""``fleet bench --only dispatch``: rerun the dispatch phase alone (~3 minutes on 2 cores) and merge it.

What it measures, on the identity model (a zero-cost engine, so only the queue's own cost is left):

* the Python client's paths, ``fleet.infer`` (one task per request) and ``fleet.infer_bulk``, and the
  variants that price Celery's extras (:func:`bench.dispatch.measure_dispatch`);
* the HTTP gateway's path, ``POST /v1/requests`` + polled ``GET /v1/requests/{id}``
  (:func:`bench.redis_cost.measure_gateway`);
* where a lone request's time goes (:func:`bench.redis_cost.lone_profile`) against one bare
  ``session.run``.

The figures replace ``dispatch`` in the ``--json`` results of an earlier run, stamped with their own
commit: the report then warns that its phases were measured at different commits (a full ``fleet bench``
measures every phase together).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.analysis import dispatch_section
from bench.ceiling import ceiling_section
from bench.dispatch import dispatch_variants, measure_dispatch
from bench.limit import bare_latency_ms, bare_session
from bench.load import closed_loop
from bench.machine import machine_facts
from bench.plan import WORKLOADS, Plan
from bench.procs import RunningFleet, flush_redis
from bench.redis_cost import GatewayServer, lone_profile, measure_gateway
from bench.report import write_report
from protocol.modelcard import load_card
from tools.build_model import PRESETS
from tools.build_model import main as build_model_main
from tools.calibration import synthetic_sequences
from tools.redis_server import EmbeddedRedis

__all__ = ["probe_gateway_and_lone", "run_dispatch_only"]


def _identity_model(plan: Plan, work_dir: Path, say: Any) -> Path:
    spec = PRESETS[plan.preset]["identity"]
    path: Path = work_dir / "models" / spec["name"] / f"{spec['name']}-1.0.0.onnx"
    if not path.exists():
        say(f"building the {plan.preset} identity model → {path}")
        build_model_main(["--preset", plan.preset, "--kind", "identity", "--out-dir", str(work_dir / "models")])
    return path


LONG_POLL_S = 30.0
"""``wait_s`` of the gateway's long-poll path (the gateway caps it at ``api.max_wait_s``)."""


def probe_gateway_and_lone(plan: Plan, model_path: Path, served: Any, redis: EmbeddedRedis, work_dir: Path,
           prompts: list[list[int]], say: Any) -> dict[str, Any]:  # fmt: skip
    """The gateway's closed loop and the lone-request profile, on one more worker of the served config."""
    assert redis.proc is not None
    cfg = replace(served, label="dispatch-probe", model_name=served.model_name.replace("-served", "-probe"))
    fleet = RunningFleet(cfg, redis.url, work_dir)
    client = fleet.start()
    gateway: GatewayServer | None = None
    try:  # the lone requests first, on an otherwise idle machine (no gateway yet), after a warm-up
        bare = bare_latency_ms(bare_session(model_path), load_card(model_path), prompts[:50])
        closed_loop(client, cfg.model_name, prompts, clients=4, max_requests=64)
        lone = lone_profile(client, cfg.model_name, prompts, requests=plan.dispatch_lone_requests, bare_ms=bare)
        say(f"lone request: {lone['pubsub']['total']:.2f} ms (bare session.run {bare:.3f} ms)")
        gateway = GatewayServer(fleet.config_path, work_dir / "logs" / "dispatch-gateway.log")
        gateway.wait_ready()
        pids = {"gateway": gateway.proc.pid, "redis": redis.proc.pid, "worker": fleet.pid}
        gw = measure_gateway(gateway, pids, redis.url, cfg.model_name, prompts, clients=plan.dispatch_clients,
                             duration_s=plan.dispatch_duration_s)  # fmt: skip
        say(f"dispatch (gateway): {gw['summary']['qps']:.0f} req/s, {gw['polls_per_request']} GETs/request")
        gw_wait = measure_gateway(gateway, pids, redis.url, cfg.model_name, prompts, clients=plan.dispatch_clients,
                                  duration_s=plan.dispatch_duration_s, long_poll_s=LONG_POLL_S)  # fmt: skip
        say(f"dispatch (gateway, long-poll): {gw_wait['summary']['qps']:.0f} req/s, "
            f"{gw_wait['polls_per_request']} GETs/request")  # fmt: skip
    finally:
        if gateway is not None:
            gateway.stop()
        fleet.stop()
    return {"gateway": gw, "gateway_wait": gw_wait, "lone_profile": lone}


def run_dispatch_only(plan: Plan, args: argparse.Namespace, command: str) -> dict[str, Any]:
    """Rerun the dispatch phase; merge it into ``args.json_path`` and rewrite the report (with no
    earlier results there, write them and the dispatch sections alone to ``args.out``).

    ``args.dispatch_json`` (optional) also receives this run's dispatch figures alone.
    """
    json_path = Path(args.json_path)
    merge = json_path.exists()
    results: dict[str, Any] = json.loads(json_path.read_text()) if merge else {"meta": {"machine": machine_facts()}}
    work_dir = Path(args.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)

    def say(msg: str) -> None:
        print(f"[bench] {msg}", file=sys.stderr)

    started = time.monotonic()
    machine = machine_facts()
    model_path = _identity_model(plan, work_dir, say)
    card = load_card(model_path)
    lo, hi = WORKLOADS["short"]
    prompts = synthetic_sequences(plan.prompts, vocab_size=card.vocab_size, min_tokens=lo, max_tokens=hi,
                                  seed=plan.seed + 101)  # fmt: skip
    variants = dispatch_variants(plan, card.name, model_path)
    with EmbeddedRedis() as redis:
        assert redis.proc is not None
        flush_redis(redis.url)
        dispatch = measure_dispatch(
            variants, redis.url, redis.proc.pid, work_dir, prompts, clients=plan.dispatch_clients,
            duration_s=plan.dispatch_duration_s, lone_requests=plan.dispatch_lone_requests, rounds=plan.rounds,
            profile_s=0.0, say=say, floors=(True, False),
        )  # fmt: skip
        dispatch.update(probe_gateway_and_lone(plan, model_path, variants["served"][1], redis, work_dir, prompts, say))
    dispatch["meta"] = {
        "command": command, "commit": machine["git_commit"], "dirty": machine["git_dirty"],
        "duration_s": round(time.monotonic() - started, 1),
        "load_average_start": machine["load_average_start"], "load_average_end": [round(x, 2) for x in os.getloadavg()],
    }  # fmt: skip
    results["dispatch"] = dispatch
    results.pop("dispatch_runs", None)  # runs merged by name (older results): the report shows one run
    if getattr(args, "dispatch_json", None):
        Path(args.dispatch_json).write_text(json.dumps(dispatch, indent=1, default=str) + "\n")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    if merge:
        write_report(results, Path(args.out), Path(args.img_dir))
    else:  # nothing to merge into: the dispatch sections alone
        Path(args.out).write_text(f"## Dispatch cost\n\n{dispatch_section(results)}\n\n{ceiling_section(results)}")
    say(f"dispatch done in {dispatch['meta']['duration_s']:.0f} s: {args.out}, {json_path}")
    return results
