"""Every configuration served at once, measured in interleaved rounds.

The machine is small and shared, so background load comes and goes. Rather than measuring one
configuration after another (where a noisy minute lands on one row only), all workers run side by
side on one Redis, each on its own queue, and the load visits them in turn: lone requests, then
``rounds`` short saturation windows per configuration (pooled), then the open-loop sweep. Idle
workers only wait on their queue.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.load import ClosedLoopRun, closed_loop, open_loop
from bench.peer import PeerWorker
from bench.plan import Plan
from bench.procs import FleetConfig, RunningFleet, peak_rss_bytes
from bench.stats import RequestRecord, summarize_run, summarize_runs
from producer.client import FleetClient
from protocol.settings import load_settings

__all__ = ["Server", "measure_servers", "start_fleet_servers", "start_peer_server"]

Say = Callable[[str], None]
Prompts = dict[str, list[list[int]]]


@dataclass
class Server:
    """One running configuration: the model key its client sends, its worker process, its facts."""

    key: str
    model: str
    client: FleetClient
    pid: int
    stop: Callable[[], None]
    info: dict[str, Any] = field(default_factory=dict)


def start_fleet_servers(configs: dict[str, FleetConfig], redis_url: str, work_dir: Path) -> dict[str, Server]:
    """Spawn every configuration's worker, then wait for each (model loads overlap).

    Raises:
        RuntimeError, TimeoutError: a worker exited or was not ready in time; every worker this call
            spawned is stopped first (none is left running behind the error).
    """
    fleets = {key: RunningFleet(cfg, redis_url, work_dir) for key, cfg in configs.items()}
    for fleet in fleets.values():
        fleet.spawn()
    servers = {}
    for key, fleet in fleets.items():
        try:
            client = fleet.ready()
        except BaseException:
            for spawned in fleets.values():
                spawned.stop()
            raise
        cfg = fleet.config
        servers[key] = Server(
            key, cfg.model_name, client, fleet.pid, fleet.stop,
            {"label": cfg.label, "model_bytes": cfg.model_path.stat().st_size, "start_s": round(fleet.start_s, 1),
             "max_batch_size": cfg.max_batch_size, "concurrency": cfg.concurrency,
             "providers_requested": list(cfg.providers), "providers_active": fleet.providers,
             "nodes_at_load": fleet.nodes},
        )  # fmt: skip
    return servers


def start_peer_server(cfg: FleetConfig, python: Path, celery_version: str, redis_url: str, work_dir: Path,
                      plan: Plan) -> Server:  # fmt: skip
    """Spawn the celery-batches peer on ``cfg``'s model and queue; returns once it is ready."""
    settings = load_settings(cfg.write(work_dir / "configs", redis_url))
    worker = PeerWorker(
        python=python, model_path=cfg.model_path, queue=settings.queue_for(cfg.model_name), redis_url=redis_url,
        flush_every=cfg.max_batch_size, flush_interval_s=plan.peer_flush_interval_s,
        max_tokens=cfg.max_input_tokens, log_path=work_dir / "logs" / "peer.log",
    )  # fmt: skip
    worker.spawn()
    worker.wait_ready()
    client = FleetClient(settings)

    def stop() -> None:
        client.close()
        worker.stop()

    return Server(
        "peer", cfg.model_name, client, worker.pid, stop,
        {"label": "peer", "model_bytes": cfg.model_path.stat().st_size, "celery": celery_version,
         "max_batch_size": cfg.max_batch_size, "flush_interval_s": plan.peer_flush_interval_s},
    )  # fmt: skip


def _warm(server: Server, seqs: list[list[int]], plan: Plan) -> None:
    closed_loop(server.client, server.model, seqs, clients=plan.concurrency, max_requests=2 * plan.concurrency)


def measure_servers(servers: dict[str, Server], prompts: Prompts, plan: Plan, say: Say) -> dict[str, Any]:
    """Lone, saturation (interleaved rounds) and open-loop figures of every server, per workload.

    Returns ``{key: {"status": "ok", **info, "peak_rss_bytes": …, "workloads": {wl: {lone, saturation,
    open: [...]}}}}``.
    """
    out: dict[str, Any] = {k: {"status": "ok", **s.info, "workloads": {}} for k, s in servers.items()}
    for wl, seqs in prompts.items():
        lone_n = plan.lone_requests[wl]
        lone: dict[str, list[RequestRecord]] = {k: [] for k in servers}
        sat: dict[str, list[ClosedLoopRun]] = {k: [] for k in servers}
        for server in servers.values():
            _warm(server, seqs, plan)
        for r in range(plan.rounds):
            for key, server in servers.items():  # lone requests: the same prompts for every server
                part = seqs[r * lone_n // plan.rounds : (r + 1) * lone_n // plan.rounds]
                lone[key] += closed_loop(server.client, server.model, part, clients=1, max_requests=len(part)).records
            for key, server in servers.items():
                sat[key].append(closed_loop(
                    server.client, server.model, seqs, clients=plan.concurrency,
                    duration_s=plan.sat_duration_s[wl] / plan.rounds + plan.sat_warmup_s[wl],
                    warmup_s=plan.sat_warmup_s[wl],
                ))  # fmt: skip
        sat_sum = {
            k: summarize_runs([(run.records, run.window) for run in runs], clients=plan.concurrency)
            for k, runs in sat.items()
        }
        opens: dict[str, list[dict[str, Any]]] = {k: [] for k in servers}
        for i, frac in enumerate(plan.open_fractions):
            for key, server in servers.items():
                rate = max(0.5, frac * sat_sum[key].qps)
                recs = open_loop(server.client, server.model, seqs, rate_qps=rate,
                                 duration_s=plan.open_duration_s[wl], seed=plan.seed + i)  # fmt: skip
                opens[key].append({"fraction": frac, "offered_qps": rate, "summary": summarize_run(recs).as_dict()})
        for key in servers:
            s = sat_sum[key]
            out[key]["workloads"][wl] = {
                "lone": summarize_run(lone[key]).as_dict(), "saturation": s.as_dict(), "open": opens[key],
            }  # fmt: skip
            say(
                f"{key}/{wl}: {s.qps:.1f} req/s at saturation (p99 {s.latency.p99_ms:.0f} ms, batch "
                f"{s.mean_batch_size:.1f}), lone p50 {out[key]['workloads'][wl]['lone']['latency']['p50_ms']:.1f} ms"
            )
    for key, server in servers.items():
        out[key]["peak_rss_bytes"] = peak_rss_bytes(server.pid)
    return out
