"""The multi-turn rows: conversations on 2 workers, without prefix reuse, with it, and with it + routing.

``fleet bench --only multiturn`` runs N conversations of T turns (32 × 6 in the full plan) against
two real workers serving the same LM, once per row:

* **no reuse** — ``prefix_cache_bytes: 0``: every turn's prefill computes the whole history;
* **reuse, any worker** — the prefix cache on, routing off: a turn reuses its history only when it
  happens to land on the worker that served the turn before;
* **reuse + routing** — the prefix cache and prefix-aware routing on: the producer sends each turn
  to the worker holding the conversation (:mod:`producer.prefix_routing`).

Each conversation is a thread: its turn t prompt is every earlier prompt and reply plus a new
seeded user message; it submits the turn, waits for the result (pub/sub), then sends the next.
Greedy, ``ignore_eos``, so every reply has exactly its token count and the rows see the same
prompts. TTFT is the worker's ``time_to_first_token_ms`` (producer submit → first token). The
workers' Prometheus series give the prefix-cache hit rate and the reused tokens; the client's
router counts the turns it routed. Figures are measured side by side in one run and reported as
ratios to the no-reuse row; nothing here asserts a speed.
"""

from __future__ import annotations

import itertools
import random
import re
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.procs import FleetConfig, RunningFleet, flush_redis
from bench.standalone import preset_model, say, write_page
from producer.client import FleetClient
from protocol.messages import InferenceResult
from protocol.modelcard import load_card
from tools.redis_server import free_port

__all__ = ["ROWS", "MultiTurnPlan", "measure_multiturn", "render_multiturn"]

Say = Callable[[str], None]

ROWS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "no_reuse": ("no reuse", {"prefix_cache_bytes": 0}, {"prefix_aware": False}),
    "reuse": ("reuse, any worker", {}, {"prefix_aware": False}),
    "reuse_routing": ("reuse + routing", {}, {"prefix_aware": True}),
}
"""Row key → (label, batching settings, routing settings)."""


@dataclass(frozen=True)
class MultiTurnPlan:
    """Sizes of the multi-turn rows (tokens in tokens)."""

    conversations: int = 32
    turns: int = 6
    user_tokens: tuple[int, int] = (24, 40)
    """Each turn's new message: uniform in this range."""
    reply_tokens: int = 16
    workers: int = 2
    max_batch_size: int = 16
    """Each worker runs every conversation it holds at once (32 over 2 workers): TTFT is the prefill and the
    step it joins, not a wait for a free slot."""
    concurrency: int = 32
    seed: int = 17


def _turn_messages(plan: MultiTurnPlan, vocab: int) -> list[list[list[int]]]:
    """``messages[conversation][turn]``: seeded ordinary ids (no pad/bos/eos)."""
    rng = random.Random(plan.seed)
    lo, hi = plan.user_tokens
    return [[[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(plan.turns)]
            for _ in range(plan.conversations)]  # fmt: skip


def _prefix_series(port: int) -> dict[str, float]:
    """The worker's prefix-cache counters: hit, miss, reused tokens."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {"hit": 0.0, "miss": 0.0, "reused_tokens": 0.0}
    for line in text.splitlines():
        if line.startswith("fleet_worker_prefix_lookups_total{"):
            found = re.search(r'result="(hit|miss)"', line)
            if found:
                out[found.group(1)] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("fleet_worker_prefix_reused_tokens_total{"):
            out["reused_tokens"] += float(line.rsplit(" ", 1)[1])
    return out


def _converse(client: FleetClient, model: str, messages: list[list[int]], reply_tokens: int) -> list[dict[str, Any]]:
    """One conversation, turn after turn; a record per turn."""
    history: list[int] = []
    records = []
    for turn, message in enumerate(messages):
        prompt = history + message
        rid = client.submit(model, prompt, generation={"max_new_tokens": reply_tokens, "temperature": 0,
                                                       "ignore_eos": True})  # fmt: skip
        result = client.result(rid, wait=True, timeout_s=600)
        assert isinstance(result, InferenceResult) and result.generation is not None
        gen = result.generation
        records.append({"turn": turn + 1, "prompt_tokens": len(prompt), "ttft_ms": gen.timings.time_to_first_token_ms,
                        "queue_ms": result.timings.queue_wait_ms, "worker": result.timings.worker,
                        "token_ids": gen.token_ids})  # fmt: skip
        history = prompt + gen.token_ids
    return records


def _row(plan: MultiTurnPlan, key: str, model_path: Path, redis_url: str, work_dir: Path,
         messages: list[list[list[int]]], say: Say) -> dict[str, Any]:  # fmt: skip
    label, batching, routing = ROWS[key]
    flush_redis(redis_url)
    max_prompt = sum(plan.user_tokens[1] + plan.reply_tokens for _ in range(plan.turns))
    fleets = [
        RunningFleet(FleetConfig(
            label=f"multiturn-{key}-{i}", model_name="multiturn-lm", model_path=model_path,
            max_batch_size=plan.max_batch_size, concurrency=plan.concurrency, max_input_tokens=max_prompt,
            max_new_tokens=plan.reply_tokens, celery_loglevel="WARNING", metrics_port=free_port(),
            batching_extra=batching, routing=routing,
        ), redis_url, work_dir)
        for i in range(plan.workers)
    ]  # fmt: skip
    try:
        for f in fleets:
            f.spawn()
        clients = [f.ready() for f in fleets]
        client = clients[0]
        before = [_prefix_series(f.config.metrics_port) for f in fleets]
        started = time.monotonic()
        with ThreadPoolExecutor(plan.conversations) as pool:
            conversations = list(pool.map(lambda m: _converse(client, "multiturn-lm", m, plan.reply_tokens), messages))
        elapsed = time.monotonic() - started
        after = [_prefix_series(f.config.metrics_port) for f in fleets]
    finally:
        for f in fleets:
            f.stop()
    counts = {k: sum(a[k] - b[k] for a, b in zip(after, before, strict=True)) for k in ("hit", "miss", "reused_tokens")}
    turns = [r for conv in conversations for r in conv]
    late = [r["ttft_ms"] for r in turns if r["turn"] >= 3]
    prompt_tokens = sum(r["prompt_tokens"] for r in turns)
    looked_up = counts["hit"] + counts["miss"]
    ttft = {"p50": float(np.percentile(late, 50)), "p90": float(np.percentile(late, 90)), "mean": float(np.mean(late))}
    row: dict[str, Any] = {
        "label": label,
        "seconds": elapsed,
        "turns": len(turns),
        "turns_per_s": len(turns) / elapsed,
        "ttft_turn3plus_ms": ttft,
        "queue_turn3plus_ms_p50": float(np.percentile([r["queue_ms"] for r in turns if r["turn"] >= 3], 50)),
        "ttft_turn1_ms_p50": float(np.percentile([r["ttft_ms"] for r in turns if r["turn"] == 1], 50)),
        "hit_rate": counts["hit"] / looked_up if looked_up else 0.0,
        "reused_token_share": counts["reused_tokens"] / prompt_tokens if prompt_tokens else 0.0,
        "routed": client.router.prefixes.routed,
        "passed_over": client.router.prefixes.passed_over,
        "not_held": client.router.prefixes.unrouted - client.router.prefixes.passed_over,
        "same_worker_share": _same_worker_share(conversations),
        "replies": [[r["token_ids"] for r in conv] for conv in conversations],
    }
    say(f"multiturn {label}: TTFT turns>=3 p50 {ttft['p50']:.1f} ms (queue {row['queue_turn3plus_ms_p50']:.1f}), "
        f"hit rate {row['hit_rate']:.0%}, {row['turns_per_s']:.1f} turns/s")
    return row


def _same_worker_share(conversations: list[list[dict[str, Any]]]) -> float:
    """Share of turns >= 2 served by the worker that served the conversation's turn before."""
    pairs = [(a["worker"], b["worker"]) for conv in conversations for a, b in itertools.pairwise(conv)]
    return sum(1 for a, b in pairs if a == b) / len(pairs) if pairs else 0.0


def measure_multiturn(
    plan: MultiTurnPlan, model_path: Path, redis_url: str, work_dir: Path, say: Say
) -> dict[str, Any]:
    """Every row of :data:`ROWS` on the same conversations; ratios against ``no_reuse``."""
    messages = _turn_messages(plan, load_card(model_path).vocab_size)
    rows = {key: _row(plan, key, model_path, redis_url, work_dir, messages, say) for key in ROWS}
    base = rows["no_reuse"]["ttft_turn3plus_ms"]["p50"]
    for row in rows.values():
        row["ttft_turn3plus_ratio"] = row["ttft_turn3plus_ms"]["p50"] / base if base else float("nan")
    same = all(r["replies"] == rows["no_reuse"]["replies"] for r in rows.values())
    for row in rows.values():
        row.pop("replies")
    return {"plan": plan.__dict__ | {"user_tokens": list(plan.user_tokens)}, "rows": rows,
            "same_replies": same}  # fmt: skip


def render_multiturn(results: dict[str, Any]) -> str:
    """The Markdown section of a :func:`measure_multiturn` result (with its ``meta``)."""
    plan, meta = results["plan"], results.get("meta", {})
    lines = [
        "# Multi-turn conversations: prefix reuse and prefix-aware routing",
        "",
        f"From one `{meta.get('command', 'fleet bench --only multiturn')}` run at commit "
        f"`{meta.get('commit', '?')}`{' (uncommitted changes)' if meta.get('dirty') else ''}, "
        f"{meta.get('machine', '')}. {plan['conversations']} conversations × {plan['turns']} turns on "
        f"{plan['workers']} workers (`max_batch_size` {plan['max_batch_size']}, C = {plan['concurrency']}); "
        f"each turn adds a {plan['user_tokens'][0]}–{plan['user_tokens'][1]}-token message and gets a "
        f"{plan['reply_tokens']}-token greedy reply; the history grows every turn.",
        "",
        "| row | TTFT turns ≥ 3, p50 (ms) | p90 (ms) | × no reuse | turn 1 p50 (ms) | hit rate | prompt tokens "
        "reused | turns on the previous turn's worker | routed / busy / not held | turns/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"].values():
        t = row["ttft_turn3plus_ms"]
        lines.append(
            f"| {row['label']} | {t['p50']:.1f} | {t['p90']:.1f} | {row['ttft_turn3plus_ratio']:.2f} | "
            f"{row['ttft_turn1_ms_p50']:.1f} | {row['hit_rate']:.0%} | {row['reused_token_share']:.0%} | "
            f"{row['same_worker_share']:.0%} | {row['routed']} / {row['passed_over']} / {row['not_held']} | "
            f"{row['turns_per_s']:.1f} |"
        )
    lines += [
        "",
        "Replies identical across the three rows (greedy): "
        + ("**yes**." if results["same_replies"] else "**no** — see the JSON."),
        "",
        "TTFT is the worker's `time_to_first_token_ms`: producer submit → first token, queue wait included. "
        "Hit rate: prompts that started from a cached prefix, of those looked up (the workers' "
        "`fleet_worker_prefix_lookups_total`). Routed: turns the producer sent to a worker's own queue; busy: "
        "held by a worker whose own queue was at `routing.max_direct_queued`, sent to the model's queue; not "
        "held: no live worker had published a block of the prompt when it was submitted (a first turn, or a "
        "prefix not yet published).",
        "",
    ]
    return "\n".join(lines)


def run_multiturn_only(quick: bool, preset: str, out_dir: Path, work_dir: Path, command: str,
                       machine: Callable[[], dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    """``fleet bench --only multiturn``: build the preset's LM if needed, run the rows, write
    ``multiturn.md`` and ``multiturn.json`` in ``out_dir``."""
    from tools.redis_server import EmbeddedRedis

    model = preset_model(preset, "lm", work_dir)
    plan = MultiTurnPlan(conversations=4, turns=3, user_tokens=(8, 12), reply_tokens=4) if quick else MultiTurnPlan()
    facts, started = machine(), time.time()
    with EmbeddedRedis() as redis:
        results = measure_multiturn(plan, model, redis.url, work_dir, say)
    write_page("multiturn", results, render_multiturn, out_dir, command=command, facts=facts, started_unix_s=started)
    return results
