"""Closed-loop load from several client *processes*, so the load generator is not the bottleneck.

One Python process submitting through :class:`producer.client.FleetClient` spends ~1.4 CPU-ms per
request under one GIL (the dispatch figures of ``docs/benchmarks.md``): it cannot drive more than a
few hundred requests per second, which is less than several workers on one GPU can serve. This
module runs ``processes`` copies of ``python -m bench.load_procs`` (each ``clients`` threads in a
closed loop for ``duration_s``, measuring a steady-state window after ``warmup_s``) and adds up
their requests per second. Each child prints one JSON line (its :class:`bench.stats.RunSummary`
figures); nothing but JSON crosses the process boundary.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["closed_loop_processes", "main"]


def closed_loop_processes(config: Path, model: str, prompts_seed: int, *, processes: int, clients: int,
                          duration_s: float, warmup_s: float, vocab_size: int,
                          prompt_tokens: tuple[int, int]) -> dict[str, Any]:  # fmt: skip
    """Run ``processes`` client processes against ``model`` (settings file ``config``) at once.

    Returns the summed ``qps`` and ``requests``, the summed ``errors``, the worst ``p99_ms`` and the
    median of the children's ``p50_ms``, plus each child's figures under ``children``.

    Raises:
        RuntimeError: a child exited non-zero (its stderr tail is in the message).
    """
    cmd = [sys.executable, "-m", "bench.load_procs", "--config", str(config), "--model", model,
           "--clients", str(clients), "--duration", str(duration_s), "--warmup", str(warmup_s),
           "--vocab-size", str(vocab_size), "--min-tokens", str(prompt_tokens[0]),
           "--max-tokens", str(prompt_tokens[1])]  # fmt: skip
    env = {**os.environ, "FLEET_CONFIG": str(config)}
    children = [
        subprocess.Popen(
            [*cmd, "--seed", str(prompts_seed + i)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        for i in range(processes)
    ]
    outputs = []
    for child in children:
        out, err = child.communicate(timeout=duration_s + 300)
        if child.returncode != 0:
            raise RuntimeError(f"load process exited {child.returncode}: {err[-2000:]}")
        outputs.append(json.loads(out.strip().splitlines()[-1]))
    p50s = sorted(o["p50_ms"] for o in outputs)
    return {
        "qps": sum(o["qps"] for o in outputs),
        "requests": sum(o["requests"] for o in outputs),
        "errors": sum(o["errors"] for o in outputs),
        "p50_ms": p50s[len(p50s) // 2],
        "p99_ms": max(o["p99_ms"] for o in outputs),
        "mean_batch_size": sum(o["mean_batch_size"] * o["requests"] for o in outputs)
        / max(1, sum(o["requests"] for o in outputs)),
        "processes": processes,
        "clients_per_process": clients,
        "children": outputs,
    }


def main(argv: list[str] | None = None) -> int:
    """One client process: a closed loop, then one JSON line of its figures on stdout."""
    from bench.load import closed_loop
    from bench.stats import summarize_run
    from producer.client import FleetClient
    from protocol.settings import load_settings
    from tools.calibration import synthetic_sequences

    p = argparse.ArgumentParser(prog="python -m bench.load_procs")
    p.add_argument("--config", type=Path, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--clients", type=int, required=True)
    p.add_argument("--duration", type=float, required=True, help="seconds of the loop, warm-up included")
    p.add_argument("--warmup", type=float, default=0.0)
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--min-tokens", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--prompts", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    prompts = synthetic_sequences(args.prompts, vocab_size=args.vocab_size, min_tokens=args.min_tokens,
                                  max_tokens=args.max_tokens, seed=args.seed)  # fmt: skip
    client = FleetClient(load_settings(args.config))
    try:
        run = closed_loop(client, args.model, prompts, clients=args.clients, duration_s=args.duration,
                          warmup_s=args.warmup)  # fmt: skip
    finally:
        client.close()
    s = summarize_run(run.records, run.window)
    print(json.dumps({"qps": s.qps, "requests": s.requests, "errors": s.errors, "p50_ms": s.latency.p50_ms,
                      "p99_ms": s.latency.p99_ms, "mean_batch_size": s.mean_batch_size}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
