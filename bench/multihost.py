"""Requests/s with 1, 2 and 3 worker hosts: the fleet across network namespaces, on the identity model.

``python -m bench.multihost`` builds the hosts of :class:`tools.multihost.HostFleet` (Redis, worker
hosts ``w1``–``w3``, a client; each its own network namespace on a private /24), then runs the same
closed loop (:func:`bench.load.closed_loop`: ``--clients`` threads of one ``FleetClient`` process on
the client host) against 1, 2, 3 worker hosts, then 3, 2, 1 again (``--passes 2``), one worker per
host. The identity model (one ``OneHot`` node) makes every request cost the queue alone: producer,
Redis, worker. Per round: requests/s in the steady window, p50/p99 latency, and CPU over the whole
round per process: Redis (% of one core, CPU-ms per request), the workers together, the client.

All hosts share this machine's cores: the figures show the protocol working across hosts and how
Redis's share grows with the hosts, not how a fleet of real machines scales. Needs root (``ip netns``).

Writes ``var/bench/multihost.json``; ``--doc docs/scale.md`` replaces the table between the markers
``<!-- multihost:begin -->`` and ``<!-- multihost:end -->``.

``python -m bench.multihost load …`` is the load generator itself (run on the client host; prints JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from bench.markdown import fmt, md_table
from tools.build_identity import build_identity
from tools.multihost import HostFleet
from tools.netns import unavailable_reason
from tools.processes import WorkerProcess

__all__ = ["main", "render_table", "round_order", "splice"]

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "var" / "bench" / "multihost.json"
BEGIN, END = "<!-- multihost:begin -->", "<!-- multihost:end -->"
PROMPTS = [[3 + i % 200] * (4 + i % 8) for i in range(64)]
"""Short prompts (4–11 tokens): the queue's cost dominates."""


def round_order(max_hosts: int, passes: int) -> list[int]:
    """Worker-host counts of the rounds: up 1..max, then down max..1, alternately (``passes`` times)."""
    up = list(range(1, max_hosts + 1))
    return [n for p in range(passes) for n in (up if p % 2 == 0 else up[::-1])]


# -- the load generator (runs on the client host) ---------------------------------------------------
def _load(args: argparse.Namespace) -> int:
    from bench.load import closed_loop
    from bench.stats import summarize_runs
    from producer.client import FleetClient
    from protocol.settings import load_settings

    client = FleetClient(load_settings(Path(args.config)))
    closed_loop(client, "identity", PROMPTS, clients=args.clients, max_requests=4 * args.clients)  # warm
    cpu0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    run = closed_loop(client, "identity", PROMPTS, clients=args.clients, duration_s=args.duration,
                      warmup_s=args.warmup)
    cpu1, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - t0
    s = summarize_runs([(run.records, run.window)], clients=args.clients)
    client.close()
    print(json.dumps({"qps": s.qps, "qps_counted": s.qps_counted, "p50_ms": s.latency.p50_ms,
                      "p99_ms": s.latency.p99_ms, "errors": s.errors, "requests": len(run.records),
                      "mean_batch": s.mean_batch_size, "wall_s": wall,
                      "cpu_s": (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)}))
    return 0


# -- the orchestrator ---------------------------------------------------------------------------------
def _cpu_s(pids: Sequence[int]) -> float:
    total = 0.0
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


def _round(hf: HostFleet, config: Path, workers: list[WorkerProcess], args: argparse.Namespace) -> dict[str, Any]:
    redis_pid = hf.pid_of("redis")
    worker_pids = [w.proc.pid for w in workers if w.proc is not None]
    argv = [sys.executable, "-m", "bench.multihost", "load", "--config", str(config), "--clients",
            str(args.clients), "--duration", str(args.duration), "--warmup", str(args.warmup)]
    r0, w0, m0 = _cpu_s([redis_pid]), _cpu_s(worker_pids), psutil.cpu_times()
    out = subprocess.run(hf.client_host.command(argv), capture_output=True, text=True, cwd=ROOT, check=False)
    r1, w1, m1 = _cpu_s([redis_pid]), _cpu_s(worker_pids), psutil.cpu_times()
    if out.returncode != 0:
        raise RuntimeError(f"the load generator failed ({out.returncode}): {out.stderr[-3000:]}")
    res: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    # the warm-up before the timed loop is outside wall_s: CPU is priced per request over the timed loop
    n = max(res["requests"], 1)
    idle = (m1.idle + getattr(m1, "iowait", 0.0)) - (m0.idle + getattr(m0, "iowait", 0.0))
    span = sum(m1) - sum(m0)
    busy_pct = 100 * (1 - idle / span) if span > 0 else float("nan")
    fleet_cores_pct = 100 * ((r1 - r0) + (w1 - w0) + res["cpu_s"]) / res["wall_s"]
    return {
        "machine_busy_pct": busy_pct,
        # the rest of the busy time: other processes on this machine (and the kernel's softirq work)
        "others_core_pct": busy_pct * (psutil.cpu_count() or 1) - fleet_cores_pct,
        "hosts": len(workers), **res,
        "redis_core_pct": 100 * (r1 - r0) / res["wall_s"], "redis_cpu_ms_per_req": 1000 * (r1 - r0) / n,
        "workers_core_pct": 100 * (w1 - w0) / res["wall_s"], "workers_cpu_ms_per_req": 1000 * (w1 - w0) / n,
        "client_core_pct": 100 * res["cpu_s"] / res["wall_s"], "client_cpu_ms_per_req": 1000 * res["cpu_s"] / n,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every round of the bench (see the module docstring); returns the report document."""
    started_load = os.getloadavg()
    folder = Path(tempfile.mkdtemp(prefix="fleet-multihost-"))
    model = build_identity(folder / "models")
    rounds: list[dict[str, Any]] = []
    with HostFleet(folder, worker_hosts=args.hosts) as hf:
        hf.start_redis()
        config = hf.config(model, worker={"concurrency": 16, "loglevel": "WARNING"},
                           models={"identity": {"batching": {"max_batch_size": 16}, "max_queue_depth": 100_000}})
        running: list[WorkerProcess] = []
        for n in round_order(args.hosts, args.passes):
            while len(running) < n:
                running.append(hf.worker(hf.worker_hosts[len(running)], config, concurrency=16))
                hf.wait_workers()
            while len(running) > n:
                running.pop().stop(timeout_s=30)
            rounds.append(_round(hf, config, running, args))
            print(f"[multihost] {n} worker host(s): {rounds[-1]['qps']:.0f} req/s, Redis "
                  f"{rounds[-1]['redis_core_pct']:.0f} % of a core", flush=True)
    return {"rounds": rounds, "clients": args.clients, "duration_s": args.duration, "warmup_s": args.warmup,
            "cpus": psutil.cpu_count(), "load_average_at_start": started_load,
            "command": "python -m bench.multihost " + " ".join(args.argv)}


def render_table(doc: dict[str, Any]) -> str:
    """The rounds as a Markdown table, in the order they ran, with each round's ratio to the first 1-host round.

    *One-Redis ceiling* = 1000 / Redis CPU-ms per request: the requests/s at which that round's traffic
    would keep one Redis core 100 % busy.
    """
    base = next(r["qps"] for r in doc["rounds"] if r["hosts"] == 1)
    rows = [[str(i + 1), str(r["hosts"]), fmt(r["qps"], 0), f"{r['qps'] / base:.2f}×", fmt(r["p50_ms"]),
             fmt(r["p99_ms"]), fmt(r["mean_batch"]), fmt(r["redis_core_pct"], 0),
             fmt(r["redis_cpu_ms_per_req"], 2), fmt(1000 / r["redis_cpu_ms_per_req"], 0),
             fmt(r["workers_cpu_ms_per_req"], 2), fmt(r["client_cpu_ms_per_req"], 2),
             fmt(r["machine_busy_pct"], 0), fmt(r["others_core_pct"], 0), str(r["errors"])]
            for i, r in enumerate(doc["rounds"])]
    return md_table(["round", "worker hosts", "req/s", "vs 1 host", "p50 ms", "p99 ms", "mean batch",
                     "Redis % of a core", "Redis CPU-ms/req", "one-Redis ceiling req/s", "workers CPU-ms/req",
                     "client CPU-ms/req", "machine busy %", "others % of a core", "errors"], rows)


def splice(doc_path: Path, table: str, command: str) -> None:
    """Replace what stands between the multihost markers of ``doc_path`` with ``command`` (a line) and ``table``.

    Raises:
        ValueError: the file lacks either marker.
    """
    text = doc_path.read_text()
    if BEGIN not in text or END not in text:
        raise ValueError(f"{doc_path} has no {BEGIN} … {END} block to replace")
    head, rest = text.split(BEGIN, 1)
    doc_path.write_text(f"{head}{BEGIN}\n{command}:\n\n{table}\n{END}{rest.split(END, 1)[1]}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["load"]:
        p = argparse.ArgumentParser(prog="python -m bench.multihost load")
        p.add_argument("--config", required=True)
        p.add_argument("--clients", type=int, required=True)
        p.add_argument("--duration", type=float, required=True)
        p.add_argument("--warmup", type=float, required=True)
        return _load(p.parse_args(argv[1:]))
    p = argparse.ArgumentParser(prog="python -m bench.multihost", description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=3, choices=range(1, 10), help="most worker hosts (default 3)")
    p.add_argument("--passes", type=int, default=2, help="up 1..N, then down N..1, … (default 2)")
    p.add_argument("--clients", type=int, default=32, help="closed-loop client threads (default 32)")
    p.add_argument("--duration", type=float, default=12.0, help="seconds per round (default 12)")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds not counted at a round's start (default 2)")
    p.add_argument("--doc", type=Path, help="Markdown file whose multihost block gets the table")
    args = p.parse_args(argv)
    args.argv = argv
    why = unavailable_reason()
    if why is not None:
        print(f"bench.multihost: {why}", file=sys.stderr)
        return 2
    doc = run(args)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(doc, indent=1))
    table = render_table(doc)
    print(table)
    if args.doc is not None:
        load = ", ".join(f"{x:.1f}" for x in doc["load_average_at_start"])
        splice(args.doc, table, f"`{doc['command']}` on {doc['cpus']} CPUs (load average {load} when it began)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
