"""Generation metrics: Prometheus series fed by the generation loop's step observer and by results.

Series (label ``model``; times in seconds):

===============================================  ==========  ============================================
``fleet_worker_generated_tokens_total``          counter     tokens generated (prefill first tokens +
                                                             decode tokens); ``rate()`` = tokens/s
``fleet_worker_prompt_tokens_total``             counter     prompt tokens of generations whose prefill
                                                             completed (= their ``usage.prompt_tokens``;
                                                             minus the prefix-reused ones = computed)
``fleet_worker_generation_finished_total``       counter     generations ended, by ``reason``: stop,
                                                             length, cancelled, deadline
``fleet_worker_time_to_first_token_seconds``     histogram   producer submit → first token
``fleet_worker_inter_token_seconds``             histogram   mean time between a request's tokens
``fleet_worker_generation_step_seconds``         histogram   one step: prefill + cache re-layout + decode
``fleet_worker_kv_copy_seconds``                 histogram   cache re-layout time per step with a
                                                             membership change
``fleet_worker_running_sequences``               gauge       sequences generating (in the running batch, or
                                                             being prefilled a chunk per step)
``fleet_worker_kv_tokens``                       gauge       real tokens held in the running KV cache
``fleet_worker_kv_copied_bytes_total``           counter     KV-cache bytes copied: re-layouts and the
                                                             graph's Concat of the past (0 in place but
                                                             prefix-cache traffic); per generated token =
                                                             its rate / the tokens' rate
``fleet_worker_kv_in_place``                     gauge       1 when the cache is written in place
                                                             (GroupQueryAttention slots), 0 for Concat
``fleet_worker_cuda_graphs``                     gauge       1 when decode steps replay CUDA graphs
                                                             (``engine.cuda_graph``, workers.cuda_graph)
``fleet_worker_prefix_lookups_total``            counter     prompts looked up in the prefix cache, by
                                                             ``result``: hit, miss (hit rate =
                                                             hit / (hit + miss))
``fleet_worker_prefix_reused_tokens_total``      counter     prompt tokens taken from the prefix cache
                                                             (their prefill skipped)
``fleet_worker_prefix_cache_bytes``              gauge       bytes of KV the prefix cache holds
``fleet_worker_prefix_cache_entries``            gauge       finished sequences it holds
===============================================  ==========  ============================================
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from workers.generation.loop import GenerationLoop, GenStepStats
from workers.generation.prefix_cache import PrefixCache

__all__ = ["TIME_BUCKETS", "GenerationMetrics"]

TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
"""Histogram buckets (s) of every worker timing metric, inference and generation alike (workers.metrics too)."""
FINISH_REASONS = ("stop", "length", "cancelled", "deadline")


def _prefix_cache(loop: GenerationLoop | None) -> PrefixCache | None:
    return loop.prefix_cache if loop is not None else None


class GenerationMetrics:
    """The generation series of one worker, registered in ``registry``."""

    def __init__(
        self, model: str, loop: GenerationLoop, registry: CollectorRegistry,
        current: Callable[[], GenerationLoop | None] | None = None,
    ) -> None:
        """``loop`` is observed now (a swap hands its observers on to the next loop); ``current()``
        returns the loop serving now, for the gauges (default: ``loop``), so a swapped-out loop (and its
        engine) is not kept alive by a gauge."""
        self.model = model
        now = current or (lambda: loop)
        m = ["model"]
        self.tokens = Counter("fleet_worker_generated_tokens", "Tokens generated.", m, registry=registry)
        self.prompt_tokens = Counter(
            "fleet_worker_prompt_tokens", "Prompt tokens of generations whose prefill completed (usage.prompt_tokens).",
            m, registry=registry,
        )
        self.prompt_tokens.labels(model)
        self.finished = Counter(
            "fleet_worker_generation_finished", "Generations ended, by finish reason.", [*m, "reason"],
            registry=registry,
        )
        self.ttft = Histogram(
            "fleet_worker_time_to_first_token_seconds", "Producer submit to first token (s).", m,
            buckets=TIME_BUCKETS, registry=registry,
        )
        self.inter_token = Histogram(
            "fleet_worker_inter_token_seconds", "Mean time between a request's consecutive tokens (s).", m,
            buckets=TIME_BUCKETS, registry=registry,
        )
        self.step = Histogram(
            "fleet_worker_generation_step_seconds", "One generation step: prefill + re-layout + decode (s).", m,
            buckets=TIME_BUCKETS, registry=registry,
        )
        self.copy = Histogram(
            "fleet_worker_kv_copy_seconds", "KV cache re-layout per membership change (s).", m,
            buckets=TIME_BUCKETS, registry=registry,
        )
        running = "Sequences generating (running, or prefilled a chunk per step)."
        Gauge("fleet_worker_running_sequences", running, m, registry=registry).labels(model).set_function(
            lambda: float(g.active) if (g := now()) is not None else 0.0
        )
        Gauge("fleet_worker_kv_tokens", "Real tokens in the running KV cache.", m, registry=registry).labels(
            model
        ).set_function(lambda: float(g.kv.kv_tokens(g.running)) if (g := now()) is not None else 0.0)
        Gauge("fleet_worker_kv_in_place", "1 when the KV cache is written in place, 0 for a Concat cache.", m,
              registry=registry).labels(model).set_function(
            lambda: float(g.kv.in_place) if (g := now()) is not None else 0.0
        )
        Gauge("fleet_worker_cuda_graphs", "1 when decode steps are replayed as CUDA graphs.", m,
              registry=registry).labels(model).set_function(
            lambda: float(g.decoder.replays_graphs) if (g := now()) is not None else 0.0
        )
        self.kv_copied = Counter(
            "fleet_worker_kv_copied_bytes", "KV-cache bytes copied (re-layouts, the graph's Concat of the past).", m,
            registry=registry,
        )
        self.kv_copied.labels(model)
        self.prefix_lookups = Counter(
            "fleet_worker_prefix_lookups", "Prompts looked up in the prefix cache, by result.", [*m, "result"],
            registry=registry,
        )
        self.prefix_reused = Counter(
            "fleet_worker_prefix_reused_tokens", "Prompt tokens taken from the prefix cache.", m, registry=registry
        )
        Gauge("fleet_worker_prefix_cache_bytes", "Bytes of KV held by the prefix cache.", m, registry=registry).labels(
            model
        ).set_function(lambda: float(c.bytes_held) if (c := _prefix_cache(now())) is not None else 0.0)
        Gauge("fleet_worker_prefix_cache_entries", "Finished sequences held by the prefix cache.", m,
              registry=registry).labels(model).set_function(
            lambda: float(c.entries) if (c := _prefix_cache(now())) is not None else 0.0
        )
        for reason in FINISH_REASONS:
            self.finished.labels(model, reason)
        for result in ("hit", "miss"):
            self.prefix_lookups.labels(model, result)
        self.prefix_reused.labels(model)
        loop.observers.append(self.on_step)

    def on_step(self, stats: GenStepStats) -> None:
        """Generation-loop observer: one step ran."""
        self.tokens.labels(self.model).inc(stats.tokens)
        self.prompt_tokens.labels(self.model).inc(stats.prompt_tokens)
        for reason in stats.finished:
            self.finished.labels(self.model, reason).inc()
        self.step.labels(self.model).observe((stats.prefill_ms + stats.copy_ms + stats.decode_ms) / 1000)
        if stats.copy_ms > 0:
            self.copy.labels(self.model).observe(stats.copy_ms / 1000)
        self.kv_copied.labels(self.model).inc(stats.kv_copied_bytes)
        if stats.prefix_lookups:
            self.prefix_lookups.labels(self.model, "hit").inc(stats.prefix_hits)
            self.prefix_lookups.labels(self.model, "miss").inc(stats.prefix_lookups - stats.prefix_hits)
            self.prefix_reused.labels(self.model).inc(stats.reused_tokens)

    def on_result(self, result: Any) -> None:
        """A ``generate`` request succeeded: observe its first-token and inter-token times."""
        generation = result.get("generation") if isinstance(result, dict) else None
        timings = generation.get("timings") if isinstance(generation, dict) else None
        if not isinstance(timings, dict):
            return
        ttft_ms = timings.get("time_to_first_token_ms")
        if isinstance(ttft_ms, int | float):
            self.ttft.labels(self.model).observe(ttft_ms / 1000)
        gap_ms = timings.get("mean_inter_token_ms")
        if isinstance(gap_ms, int | float) and len(generation.get("token_ids") or ()) > 1:  # type: ignore[union-attr]
            self.inter_token.labels(self.model).observe(gap_ms / 1000)
