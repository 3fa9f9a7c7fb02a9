"""The streaming rows: what publishing token events costs the worker, one XADD per event against coalesced.

``fleet bench --only streaming`` builds a ~7 M-weight Llama (the size at which publishing weighed most:
its decode steps are short, so tokens come fast) and runs, in this process, the generation loop with
every sequence streaming into the worker's own :class:`~workers.stream_publisher.StreamPublisher`
(a private redis-server), ``requests`` arriving together, in interleaved rounds, three ways:

* **one XADD per event** (``max_events_per_entry`` 1: the publisher before coalescing);
* **coalesced** (the default: each write carries every pending event of a stream in one entry);
* **coalesced, with a window** of each of ``windows_ms`` (``worker.stream_window_ms``: the publisher waits
  that long after the first pending event, so each entry holds the tokens of several decode steps).

Figures: the publisher thread's CPU time as a share of the process's CPU time over the run (the
scheduler thread's construction of each event is not in it: it is the same in every row), events per
entry, Redis's CPU per event (``INFO commandstats``: the write script's runs), and tokens/s.
Nothing asserts a speed.
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

import redis

from bench.standalone import built, say, write_page
from protocol.messages import GenerationParams
from protocol.modelcard import load_card
from protocol.settings import BatchingSettings, EngineSettings, LimitSettings
from workers.engine import Engine
from workers.generation.inplace_check import open_decoder
from workers.generation.loop import GenerationLoop
from workers.generation.sequence import GenSequence
from workers.stream_publisher import StreamPublisher

__all__ = ["StreamPlan", "measure_streaming", "render_streaming", "run_streaming_only"]


@dataclass(frozen=True)
class StreamPlan:
    """Sizes of the streaming rows."""

    requests: int = 48
    rounds: int = 7
    windows_ms: tuple[float, ...] = (10.0, 25.0)


QUICK = StreamPlan(requests=4, rounds=1)


def modes(plan: StreamPlan) -> dict[str, dict[str, float]]:
    """Row label → the publisher's ``max_events_per_entry`` and ``window_ms``."""
    out = {"one XADD per event": {"max_events_per_entry": 1, "window_ms": 0.0},
           "coalesced, no window": {"max_events_per_entry": 64, "window_ms": 0.0}}
    for window in plan.windows_ms:
        out[f"coalesced, {window:.0f} ms window"] = {"max_events_per_entry": 64, "window_ms": window}
    return out


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _redis_cpu_us(client: redis.Redis[bytes]) -> float:
    """Redis's CPU time in the publisher's writes so far (µs): its script runs (whose time holds the
    ``XADD`` and ``EXPIRE`` they call), or those commands sent one by one."""
    stats = client.info("commandstats")

    def usec(*commands: str) -> float:
        return sum(float(stats.get(f"cmdstat_{c}", {}).get("usec", 0)) for c in commands)

    return usec("evalsha", "eval") or usec("xadd", "expire")


def one_run(loop: GenerationLoop, publisher: StreamPublisher, client: redis.Redis[bytes],
            work: list[tuple[list[int], int]]) -> dict[str, float]:  # fmt: skip
    """The burst through ``loop``, every sequence streaming into ``publisher``; waits until it wrote all."""
    published, entries, pub_cpu = publisher.published, publisher.entries, publisher.cpu_s
    redis_us = _redis_cpu_us(client)
    cpu, started = _cpu_s(), time.monotonic()
    seqs = [GenSequence(request_id=f"s{time.monotonic_ns()}-{i}", prompt=list(p), eos_ids=frozenset(),
                        params=GenerationParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, stream=True),
                        emit=publisher, arrived_s=time.monotonic())
            for i, (p, n) in enumerate(work)]  # fmt: skip
    pending = list(seqs)
    while pending or loop.has_work():
        count = loop.admissible(pending)
        joiners, pending = pending[:count], pending[count:]
        loop.step(joiners)
    events = sum(n + 1 for _, n in work)
    deadline = time.monotonic() + 30
    while publisher.published - published < events and time.monotonic() < deadline:
        time.sleep(0.002)
    elapsed, process_cpu = time.monotonic() - started, _cpu_s() - cpu
    written = publisher.published - published
    return {
        "tokens_per_s": sum(n for _, n in work) / elapsed,
        "publisher_cpu_share": (publisher.cpu_s - pub_cpu) / process_cpu,
        "events_per_entry": written / max(1, publisher.entries - entries),
        "redis_us_per_event": (_redis_cpu_us(client) - redis_us) / max(1, written),
        "written": float(written == events),
    }


def measure_streaming(plan: StreamPlan, model: Path, redis_url: str, say: Callable[[str], None]) -> dict[str, Any]:
    """Every figure of the streaming rows (see the module docstring), JSON-friendly."""
    card = load_card(model)
    engine = Engine(model, card, EngineSettings(providers=["CPUExecutionProvider"]),
                    BatchingSettings(max_batch_size=16), LimitSettings())  # fmt: skip
    loop = GenerationLoop(open_decoder(engine), BatchingSettings(max_batch_size=16, prefix_cache_bytes=0,
                                                                 max_batch_tokens=16 * 64))
    rng = random.Random(31)
    work = [([rng.randrange(3, card.vocab_size) for _ in range(rng.randint(10, 64))], rng.randint(19, 63))
            for _ in range(plan.requests)]
    client: redis.Redis[bytes] = redis.Redis.from_url(redis_url)
    publishers = {}
    rows_of = modes(plan)
    for mode, spec in rows_of.items():
        publishers[mode] = StreamPublisher(redis.Redis.from_url(redis_url), ttl_s=120, window_ms=spec["window_ms"],
                                           max_events_per_entry=int(spec["max_events_per_entry"]))
        publishers[mode].start()
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in rows_of}
    try:
        order = list(rows_of)
        for round_ in range(plan.rounds):
            for mode in order if round_ % 2 == 0 else order[::-1]:
                runs[mode].append(one_run(loop, publishers[mode], client, work))
                r = runs[mode][-1]
                say(f"round {round_ + 1}/{plan.rounds} {mode}: publisher {r['publisher_cpu_share']:.1%} of the "
                    f"process CPU, {r['events_per_entry']:.1f} events/entry, {r['tokens_per_s']:.0f} tokens/s")
    finally:
        for publisher in publishers.values():
            publisher.stop()
        client.close()
    rows = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()}
    return {"model": {"name": card.name, "layers": card.num_layers, "hidden": card.hidden_size,
                      "vocab": card.vocab_size},
            "plan": plan.__dict__, "rows": rows,
            "rounds": {m: [round(r["publisher_cpu_share"], 4) for r in rs] for m, rs in runs.items()}}


def render_streaming(results: dict[str, Any]) -> str:
    """The Markdown page of a :func:`measure_streaming` result (with its ``meta``)."""
    plan, meta, m = results["plan"], results.get("meta", {}), results["model"]
    lines = [
        "# Streaming: what publishing token events costs a worker",
        "",
        f"From one `{meta.get('command', 'fleet bench --only streaming')}` run at commit `{meta.get('commit', '?')}`"
        f"{' (uncommitted changes)' if meta.get('dirty') else ''}, {meta.get('machine', '')}, "
        f"{meta.get('duration_s', 0):.0f} s. Model: `{m['name']}` ({m['layers']} layers, hidden {m['hidden']}, "
        f"vocabulary {m['vocab']}); {plan['requests']} streaming generations arriving together through the "
        f"generation loop, each token an event to the worker's stream publisher and a private redis-server; "
        f"{plan['rounds']} interleaved rounds (medians).",
        "",
        "| publisher | its CPU, share of the process's | events per entry | Redis CPU per event (µs) | tokens/s |",
        "|---|---|---|---|---|",
    ]
    for mode, row in results["rows"].items():
        lines.append(f"| {mode} | {row['publisher_cpu_share']:.1%} | {row['events_per_entry']:.1f} | "
                     f"{row['redis_us_per_event']:.2f} | {row['tokens_per_s']:.0f} |")
    lines += [
        "",
        "How it is measured: `bench/streaming.py`. The publisher thread's CPU is `time.thread_time()` summed "
        "in its loop; the process's is user + system time over the run, until the last event is written. "
        "Building each event (on the scheduler thread) is not in the publisher's share and is the same in "
        "every row. Per-row shares per round: "
        + "; ".join(f"{mode}: {', '.join(f'{x:.1%}' for x in xs)}" for mode, xs in results["rounds"].items())
        + ".",
        "",
    ]
    return "\n".join(lines)


def run_streaming_only(quick: bool, preset: str, out_dir: Path, work_dir: Path, command: str,
                       machine: Callable[[], dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    """``fleet bench --only streaming``: build the ~7 M Llama if needed (whatever the ``preset``), run the rows,
    write ``streaming.md`` and ``streaming.json`` in ``out_dir``."""
    from tools.build_llama import build_llama
    from tools.redis_server import EmbeddedRedis

    name = "stream-llama-7m"
    model = built(work_dir / "models" / name / f"{name}-1.0.0.onnx", name,
                  lambda: build_llama(work_dir / "models", name=name, num_layers=4, hidden_size=256, num_heads=8,
                                      num_kv_heads=4, vocab_size=8192, max_positions=512))  # fmt: skip
    facts, started = machine(), time.time()
    with EmbeddedRedis() as server:
        results = measure_streaming(QUICK if quick else StreamPlan(), model, server.url, say)
    return write_page("streaming", results, render_streaming, out_dir, command=command, facts=facts,
                      started_unix_s=started)  # fmt: skip
