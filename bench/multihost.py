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
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from bench.markdown import fmt, md_table
from producer.cli_types import number_in
from tools.build_identity import build_identity
from tools.multihost import HostFleet
from tools.netns import unavailable_reason
from tools.processes import WorkerProcess

__all__ = ["main", "render_table", "round_figures", "round_order", "splice"]

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "var" / "bench" / "multihost.json"
BEGIN, END = "<!-- multihost:begin -->", "<!-- multihost:end -->"
PROMPTS = [[3 + i % 200] * (4 + i % 8) for i in range(64)]
"""Short prompts (4–11 tokens): the queue's cost dominates."""


def round_order(max_hosts: int, passes: int) -> list[int]:
    """Worker-host counts of the rounds: up 1..max, then down max..1, alternately (``passes`` times)."""
    up = list(range(1, max_hosts + 1))
    return [n for p in range(passes) for n in (up if p % 2 == 0 else up[::-1])]


# -- meters -----------------------------------------------------------------------------------------
def _cpu_s(pids: Sequence[int]) -> float:
    """User + system CPU seconds so far of the processes ``pids`` (threads included)."""
    total = 0.0
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


def _machine_busy_idle_s() -> tuple[float, float]:
    """(busy, idle) CPU seconds of the whole machine so far (guest time is already inside user time)."""
    t = psutil.cpu_times()
    idle = t.idle + getattr(t, "iowait", 0.0)
    busy = t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0) + getattr(t, "steal", 0.0)
    return busy, idle


def _meter(groups: dict[str, list[int]]) -> dict[str, float]:
    busy, idle = _machine_busy_idle_s()
    return {"machine_busy": busy, "machine_idle": idle, "self": _cpu_s([os.getpid()]),
            **{name: _cpu_s(pids) for name, pids in groups.items()}}


# -- the load generator (runs on the client host) ---------------------------------------------------
def _load(args: argparse.Namespace) -> int:
    """Warm up, then one timed closed loop; prints its figures and the CPU each process group spent in it."""
    from bench.load import closed_loop
    from bench.stats import summarize_runs
    from producer.client import FleetClient
    from protocol.settings import load_settings

    groups: dict[str, list[int]] = json.loads(args.meter)
    client = FleetClient(load_settings(Path(args.config)))
    closed_loop(client, "identity", PROMPTS, clients=args.clients, max_requests=4 * args.clients)  # warm
    before, t0 = _meter(groups), time.perf_counter()
    run = closed_loop(client, "identity", PROMPTS, clients=args.clients, duration_s=args.duration,
                      warmup_s=args.warmup)
    after, wall = _meter(groups), time.perf_counter() - t0
    s = summarize_runs([(run.records, run.window)], clients=args.clients)
    client.close()
    print(json.dumps({"qps": s.qps, "qps_counted": s.qps_counted, "p50_ms": s.latency.p50_ms,
                      "p99_ms": s.latency.p99_ms, "errors": s.errors, "requests": len(run.records),
                      "mean_batch": s.mean_batch_size, "wall_s": wall,
                      "cpu_s": {k: after[k] - before[k] for k in after}}))
    return 0


# -- the orchestrator ---------------------------------------------------------------------------------
def round_figures(res: dict[str, Any], cpus: int) -> dict[str, Any]:
    """Per-request CPU and shares of a core from a load run's output (``cpu_s`` per group over ``wall_s``)."""
    cpu, wall, n = res["cpu_s"], res["wall_s"], max(res["requests"], 1)
    span = cpu["machine_busy"] + cpu["machine_idle"]
    busy_pct = 100 * cpu["machine_busy"] / span if span > 0 else float("nan")
    fleet_s = cpu["redis"] + cpu["workers"] + cpu["self"]
    out: dict[str, Any] = {
        "machine_busy_pct": busy_pct,
        # the rest of the busy time: other processes on this machine (and the kernel's own work, the bridge's)
        "others_core_pct": busy_pct * cpus - 100 * fleet_s / wall,
    }
    for name, key in (("redis", "redis"), ("workers", "workers"), ("client", "self")):
        out[f"{name}_core_pct"] = 100 * cpu[key] / wall
        out[f"{name}_cpu_ms_per_req"] = 1000 * cpu[key] / n
    return out


def _round(hf: HostFleet, config: Path, workers: list[WorkerProcess], args: argparse.Namespace) -> dict[str, Any]:
    groups = {"redis": [hf.pid_of("redis")], "workers": [w.proc.pid for w in workers if w.proc is not None]}
    argv = [sys.executable, "-m", "bench.multihost", "load", "--config", str(config), "--clients",
            str(args.clients), "--duration", str(args.duration), "--warmup", str(args.warmup),
            "--meter", json.dumps(groups)]
    out = subprocess.run(hf.client_host.command(argv), capture_output=True, text=True, cwd=ROOT, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"the load generator failed ({out.returncode}): {out.stderr[-3000:]}")
    res: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return {"hosts": len(workers), **res, **round_figures(res, psutil.cpu_count() or 1)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every round of the bench (see the module docstring); returns the report document."""
    started_load = os.getloadavg()
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="fleet-multihost-") as tmp, HostFleet(Path(tmp), args.hosts) as hf:
        model = build_identity(Path(tmp) / "models")
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


_seconds = number_in(float, 0, 600, "seconds outside 0..600 are refused")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["load"]:
        p = argparse.ArgumentParser(prog="python -m bench.multihost load")
        p.add_argument("--config", required=True)
        p.add_argument("--clients", type=int, required=True)
        p.add_argument("--duration", type=float, required=True)
        p.add_argument("--warmup", type=float, required=True)
        p.add_argument("--meter", required=True, help='JSON {"group": [pid, ...]}: CPU measured per group')
        return _load(p.parse_args(argv[1:]))
    p = argparse.ArgumentParser(prog="python -m bench.multihost", description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=3, choices=range(1, 10), metavar="1..9",
                   help="most worker hosts (default 3)")
    p.add_argument("--passes", type=int, default=2, choices=range(1, 5), metavar="1..4",
                   help="up 1..N, then down N..1, … (default 2)")
    p.add_argument("--clients", type=int, default=32, choices=range(1, 257), metavar="1..256",
                   help="closed-loop client threads (default 32)")
    p.add_argument("--duration", type=_seconds, default=12.0, help="seconds per round, 1..600 (default 12)")
    p.add_argument("--warmup", type=_seconds, default=2.0,
                   help="seconds not counted at a round's start, below --duration (default 2)")
    p.add_argument("--doc", type=Path, help="Markdown file whose multihost block gets the table")
    args = p.parse_args(argv)
    if args.warmup >= args.duration:
        p.error(f"--warmup {args.warmup:g} must be below --duration {args.duration:g}")
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
