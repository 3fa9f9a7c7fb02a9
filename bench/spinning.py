"""The spinning rows: ONNX Runtime's spin-waiting off, on, and bounded, on the two kinds of work a worker does.

``fleet bench --only spinning`` loads the preset's LM three times in this process
(``engine.allow_spinning`` false, true and ``bounded`` with ``spin_duration_us``) and measures each, in
interleaved rounds:

* **generation steps back to back**: ``requests`` arriving together through the generation loop
  (:class:`~workers.generation.loop.GenerationLoop`, the in-place cache): tokens/s. Between two decode
  steps the scheduler thread samples and emits (about a millisecond): spinning threads are awake for
  the next step, sleeping ones must be woken;
* **one-step traffic with idle gaps**: lone next-token requests (``Engine.run``, batch 1, 16 tokens),
  each followed by ``gap_ms`` of nothing: median latency, and the process's CPU time per request
  including the gap (what spinning burns while a worker waits for work: cores Celery and Redis need);
* **one-step traffic back to back**: batches of 8 × 32 tokens with no gap: requests/s.

Then the same work goes through a real worker per mode (:func:`fleet_rows`: Celery, Redis, results),
where spinning threads compete with the worker's own threads. Nothing asserts a speed; ``spinning.md``
reports the medians and the ratios to the ``off`` row.
"""

from __future__ import annotations

import random
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.kvcache import loop_burst
from bench.standalone import preset_model, say, write_page
from protocol.modelcard import load_card
from protocol.settings import BatchingSettings, EngineSettings, LimitSettings
from workers.engine import Engine
from workers.generation.inplace_check import open_decoder
from workers.generation.loop import GenerationLoop
from workers.padding import pad_batch

__all__ = ["MODES", "SpinPlan", "measure_spinning", "render_spinning", "run_spinning_only"]

MODES: dict[str, bool | str] = {"off": False, "on": True, "bounded": "bounded"}


@dataclass(frozen=True)
class SpinPlan:
    """Sizes of the spinning rows."""

    requests: int = 16
    lone_requests: int = 40
    gap_ms: float = 20.0
    back_to_back: int = 40
    rounds: int = 3
    spin_duration_us: int = 2000
    fleet_lone: int = 60
    """Through a worker: sequential lone next-token requests, ``gap_ms`` apart."""
    fleet_callers: int = 8
    fleet_calls: int = 25
    """Through a worker: closed-loop callers and requests each."""


QUICK = SpinPlan(requests=4, lone_requests=6, back_to_back=6, rounds=1, fleet_lone=5, fleet_callers=2, fleet_calls=3)


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def lone_requests(engine: Engine, count: int, gap_ms: float) -> dict[str, float]:
    """``count`` lone batch-1 runs, each followed by ``gap_ms`` idle: median ms and CPU ms per request."""
    batch = pad_batch([[5] * 16], engine.card.pad_token_id)
    engine.run(batch)
    latencies = []
    cpu_before = _cpu_s()
    for _ in range(count):
        started = time.perf_counter()
        engine.run(batch)
        latencies.append(1000 * (time.perf_counter() - started))
        time.sleep(gap_ms / 1000)
    return {"latency_ms": statistics.median(latencies), "cpu_ms_per_request": 1000 * (_cpu_s() - cpu_before) / count}


def back_to_back(engine: Engine, count: int) -> float:
    """Requests/s of ``count`` batches of 8 × 32 tokens run with no gap."""
    batch = pad_batch([[5 + i] * 32 for i in range(8)], engine.card.pad_token_id)
    engine.run(batch)
    started = time.perf_counter()
    for _ in range(count):
        engine.run(batch)
    return 8 * count / (time.perf_counter() - started)


def measure_spinning(plan: SpinPlan, model: Path, say: Callable[[str], None]) -> dict[str, Any]:
    """Every figure of the spinning rows (see the module docstring), JSON-friendly."""
    card = load_card(model)
    engines: dict[str, Engine] = {}
    loops: dict[str, GenerationLoop] = {}
    for mode, value in MODES.items():
        settings = EngineSettings(providers=["CPUExecutionProvider"], allow_spinning=value,  # type: ignore[arg-type]
                                  spin_duration_us=plan.spin_duration_us)
        batching = BatchingSettings(max_batch_size=16, prefix_cache_bytes=0, max_batch_tokens=16 * 64)
        engines[mode] = Engine(model, card, settings, batching, LimitSettings())
        loops[mode] = GenerationLoop(open_decoder(engines[mode]), batching)
    rng = random.Random(23)
    work = [([rng.randrange(3, card.vocab_size) for _ in range(rng.randint(10, 64))], rng.randint(19, 63))
            for _ in range(plan.requests)]
    figures: dict[str, dict[str, list[float]]] = {m: {"tokens_per_s": [], "latency_ms": [], "cpu_ms_per_request": [],
                                                      "requests_per_s": []} for m in MODES}  # fmt: skip
    order = list(MODES)
    for round_ in range(plan.rounds):
        for mode in order if round_ % 2 == 0 else order[::-1]:
            f = figures[mode]
            f["tokens_per_s"].append(loop_burst(loops[mode], work)["tokens_per_s"])
            lone = lone_requests(engines[mode], plan.lone_requests, plan.gap_ms)
            f["latency_ms"].append(lone["latency_ms"])
            f["cpu_ms_per_request"].append(lone["cpu_ms_per_request"])
            f["requests_per_s"].append(back_to_back(engines[mode], plan.back_to_back))
            say(f"round {round_ + 1}/{plan.rounds} {mode}: generation {f['tokens_per_s'][-1]:.0f} tokens/s, lone "
                f"{f['latency_ms'][-1]:.2f} ms ({f['cpu_ms_per_request'][-1]:.1f} CPU-ms/request), back to back "
                f"{f['requests_per_s'][-1]:.0f} req/s")
    rows = {m: {k: statistics.median(v) for k, v in f.items()} for m, f in figures.items()}
    def ratio(mode: str, key: str) -> float:
        return statistics.median(a / b for a, b in zip(figures[mode][key], figures["off"][key], strict=True))

    ratios = {m: {"generation": ratio(m, "tokens_per_s"), "back_to_back": ratio(m, "requests_per_s")} for m in MODES}
    return {"model": card.name, "plan": plan.__dict__, "rows": rows, "ratios": ratios,
            "rounds": {m: {k: [round(x, 2) for x in v] for k, v in f.items()} for m, f in figures.items()}}


def _closed_loop(client: Any, model: str, callers: int, calls: int) -> float:
    """Requests/s of ``callers`` threads each sending ``calls`` next-token requests, one after the other."""
    from concurrent.futures import ThreadPoolExecutor

    def caller(seed: int) -> None:
        for i in range(calls):
            rid = client.submit(model, [5 + (seed + i) % 50] * 16, kind="next_token")
            client.result(rid, wait=True, timeout_s=120)

    started = time.perf_counter()
    with ThreadPoolExecutor(callers) as pool:
        list(pool.map(caller, range(callers)))
    return callers * calls / (time.perf_counter() - started)


def fleet_rows(plan: SpinPlan, model: Path, redis_url: str, work_dir: Path,
               say: Callable[[str], None]) -> dict[str, dict[str, float]]:  # fmt: skip
    """The same three kinds of work through a real worker per mode (Celery, Redis, results): lone
    next-token requests ``gap_ms`` apart (client-side latency, the worker's CPU per request), the
    generation burst (tokens/s) and closed-loop callers (req/s)."""
    from bench.procs import CpuMeter, FleetConfig, RunningFleet, flush_redis
    from protocol.messages import GenerationParams

    card = load_card(model)
    rng = random.Random(29)
    burst = [([rng.randrange(3, card.vocab_size) for _ in range(rng.randint(10, 64))], rng.randint(19, 63))
             for _ in range(plan.requests)]
    rows: dict[str, dict[str, float]] = {}
    for mode, value in MODES.items():
        config = FleetConfig(label=f"spinning-{mode}", model_name=card.name, model_path=model, max_batch_size=16,
                             concurrency=16, celery_loglevel="WARNING", max_new_tokens=64,
                             engine_extra={"allow_spinning": value, "spin_duration_us": plan.spin_duration_us})
        fleet = RunningFleet(config, redis_url, work_dir)
        client = fleet.start()
        try:
            meter = CpuMeter({"worker": fleet.pid})
            latencies = []
            for _ in range(plan.fleet_lone):
                started = time.perf_counter()
                rid = client.submit(card.name, [5] * 16, kind="next_token")
                client.result(rid, wait=True, timeout_s=120)
                latencies.append(1000 * (time.perf_counter() - started))
                time.sleep(plan.gap_ms / 1000)
            worker_cpu_ms = 1000 * meter.elapsed()["worker"] / plan.fleet_lone
            started = time.perf_counter()
            ids = [client.submit(card.name, prompt, generation=GenerationParams(
                max_new_tokens=n, temperature=0.0, ignore_eos=True, stream=False)) for prompt, n in burst]
            for rid in ids:
                client.result(rid, wait=True, timeout_s=300)
            tokens_per_s = sum(n for _, n in burst) / (time.perf_counter() - started)

            requests_per_s = _closed_loop(client, card.name, plan.fleet_callers, plan.fleet_calls)
        finally:
            fleet.stop()
            flush_redis(redis_url)
        rows[mode] = {"lone_p50_ms": statistics.median(latencies), "worker_cpu_ms_per_lone": worker_cpu_ms,
                      "tokens_per_s": tokens_per_s, "requests_per_s": requests_per_s}
        say(f"through a worker, {mode}: lone p50 {rows[mode]['lone_p50_ms']:.1f} ms ({worker_cpu_ms:.1f} worker "
            f"CPU-ms each), generation {tokens_per_s:.0f} tokens/s, {plan.fleet_callers} callers "
            f"{requests_per_s:.0f} req/s")
    return rows


def render_spinning(results: dict[str, Any]) -> str:
    """The Markdown page of a :func:`measure_spinning` result (with its ``meta``)."""
    plan, meta = results["plan"], results.get("meta", {})
    lines = [
        "# ONNX Runtime spin-waiting: off, on, bounded",
        "",
        f"From one `{meta.get('command', 'fleet bench --only spinning')}` run at commit `{meta.get('commit', '?')}`"
        f"{' (uncommitted changes)' if meta.get('dirty') else ''}, {meta.get('machine', '')}, "
        f"{meta.get('duration_s', 0):.0f} s. Model: `{results['model']}`, one process, CPU provider (ORT's "
        f"default thread count), {plan['rounds']} interleaved rounds (medians); `bounded` spins at most "
        f"{plan['spin_duration_us']} µs after each run.",
        "",
        f"| spinning | generation: {plan['requests']} requests together (tokens/s) | × off | lone next-token "
        f"request, {plan['gap_ms']:.0f} ms idle after each: latency (ms) | CPU-ms per lone request (gap included) | "
        "back-to-back batches of 8 (req/s) | × off |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, row in results["rows"].items():
        ratio = results["ratios"][mode]
        lines.append(f"| {mode} | {row['tokens_per_s']:.0f} | {ratio['generation']:.2f} | {row['latency_ms']:.2f} | "
                     f"{row['cpu_ms_per_request']:.1f} | {row['requests_per_s']:.0f} | {ratio['back_to_back']:.2f} |")
    fleet = results.get("fleet")
    if fleet:
        off = fleet["off"]
        lines += [
            "",
            "Through a real worker (Celery threads pool, C = 16, `max_batch_size` 16, Redis on the same 2 cores), "
            "one worker per row, in turn:",
            "",
            f"| spinning | lone next-token request, {plan['gap_ms']:.0f} ms apart: p50 (ms) | worker CPU-ms per lone "
            f"request | generation: {plan['requests']} requests together (tokens/s) | × off | "
            f"{plan['fleet_callers']} closed-loop callers (req/s) | × off |",
            "|---|---|---|---|---|---|---|",
        ]
        for mode, row in fleet.items():
            lines.append(f"| {mode} | {row['lone_p50_ms']:.1f} | {row['worker_cpu_ms_per_lone']:.1f} | "
                         f"{row['tokens_per_s']:.0f} | {row['tokens_per_s'] / off['tokens_per_s']:.2f} | "
                         f"{row['requests_per_s']:.0f} | {row['requests_per_s'] / off['requests_per_s']:.2f} |")
    lines += [
        "",
        "How it is measured: `bench/spinning.py`. CPU-ms per lone request is the process's user + system time "
        "over the whole sequence of requests and gaps, per request: with ORT's own spinning, threads keep a "
        "core busy after every run, time a worker's Celery and Redis threads then do not get.",
        "",
    ]
    return "\n".join(lines)


def run_spinning_only(quick: bool, preset: str, out_dir: Path, work_dir: Path, command: str,
                      machine: Callable[[], dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    """``fleet bench --only spinning``: build the preset's LM if needed, run the rows, write ``spinning.md``
    and ``spinning.json`` in ``out_dir``."""
    from tools.redis_server import EmbeddedRedis

    model = preset_model(preset, "lm", work_dir)
    facts, started = machine(), time.time()
    plan = QUICK if quick else SpinPlan()
    results = measure_spinning(plan, model, say)
    with EmbeddedRedis() as redis:
        results["fleet"] = fleet_rows(plan, model, redis.url, work_dir, say)
    return write_page("spinning", results, render_spinning, out_dir, command=command, facts=facts,
                      started_unix_s=started)  # fmt: skip
