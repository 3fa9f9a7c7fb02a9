"""The generation limit: the worker's own generation code in this process, no Celery, no Redis.

* :func:`decode_limit` — :class:`~workers.generation.decoder.Decoder` + ``KVState`` directly: prefill
  ``b`` prompts, then the same number of decode steps for every row (nobody leaves, nobody joins),
  greedy. The ceiling of a batch of ``b`` on this workload's prompts.
* :func:`loop_run` — :class:`~workers.generation.loop.GenerationLoop` driven as the worker's
  scheduler drives it (``admissible`` → ``step``) over a whole workload submitted at once, with an
  observer on every step: tokens/s, time to first token, and where the step time went (prefill, KV
  re-layout on membership changes, decode).
* :func:`relayout_cost` — one membership change (a row leaves, one joins) against a single copy of
  the cache it produces.
* :func:`concat_share` — ONNX Runtime's profiler over decode steps: the share of the graph's node
  time spent in ``Concat`` — ``present = Concat(past, new)``, the copy of the whole KV cache every
  decode step makes inside the model.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnxruntime as ort

from bench.genstats import step_shares
from bench.stats import summarize_latencies
from protocol.messages import GenerationParams
from protocol.modelcard import ModelCard
from protocol.settings import BatchingSettings, EngineSettings, LimitSettings
from workers.engine import Engine, session_options
from workers.generation.batch_kv import ConcatKV
from workers.generation.decoder import Decoder, KVState
from workers.generation.inplace_check import open_decoder
from workers.generation.inplace_decoder import InPlaceDecoder
from workers.generation.loop import GenerationLoop, GenStepStats
from workers.generation.sequence import GenSequence
from workers.kv_dtype import session_kv_dtype
from workers.ort_session import open_session

__all__ = ["Work", "concat_share", "decode_limit", "load_engine", "loop_run", "relayout_cost"]

Work = list[tuple[list[int], int]]
"""A generation workload: (prompt ids, max_new_tokens) per request."""

ENGINE = EngineSettings(providers=["CPUExecutionProvider"])
"""The worker's engine settings as the bench serves them (CPU, spin-waiting off)."""


def engine_settings(providers: Sequence[str] = ("CPUExecutionProvider",)) -> EngineSettings:
    """:data:`ENGINE` on ``providers`` (a GPU chain refuses to run on CPU: ``require_provider``)."""
    if tuple(providers) == ("CPUExecutionProvider",):
        return ENGINE
    return ENGINE.model_copy(update={"providers": list(providers), "require_provider": providers[0]})


def load_engine(model_path: Path, card: ModelCard, max_batch_size: int,
                providers: Sequence[str] = ("CPUExecutionProvider",),
                kv_cache: Literal["auto", "in_place", "concat"] = "auto",
                cuda_graph: bool = False) -> Engine:  # fmt: skip
    """An engine with the worker's session options on ``providers`` (no warm-up), with ``kv_cache``
    (``auto``: the cache a worker would serve) and ``engine.cuda_graph``.

    Raises:
        ProviderUnavailable: a GPU chain whose first provider is not active.
    """
    settings = engine_settings(providers).model_copy(update={"kv_cache": kv_cache, "cuda_graph": cuda_graph})
    return Engine(model_path, card, settings, BatchingSettings(max_batch_size=max_batch_size),
                  LimitSettings())  # fmt: skip


def decode_limit(engine: Engine, prompts: Sequence[Sequence[int]], batch_size: int, steps: int) -> dict[str, Any]:
    """Prefill ``batch_size`` prompts together, then ``steps`` decode steps for all rows (greedy).

    Returns tokens/s with the prefill counted (``tokens_per_s``: ``b x (steps + 1)`` tokens over
    prefill + re-layout + decode) and without (``decode_tokens_per_s``), and ms per decode step. Runs on the
    cache the engine serves (in place: the slots of :mod:`workers.generation.slots`, no re-layout).
    """
    decoder = open_decoder(engine)
    rows = [list(prompts[i % len(prompts)]) for i in range(batch_size)]
    if isinstance(decoder, InPlaceDecoder):
        return _decode_limit_in_place(decoder, rows, steps)
    state = KVState()
    started = time.perf_counter()
    prefill = decoder.prefill(rows)
    copy_ms = state.relayout([], prefill, list(range(batch_size)))
    tokens = [int(t) for t in np.argmax(prefill.last_logits, axis=1)]
    decode_started = time.perf_counter()
    for _ in range(steps):
        logits, _ms = decoder.decode(state, tokens)
        tokens = [int(t) for t in np.argmax(logits, axis=1)]
    return _limit_row(batch_size, steps, started, decode_started, prefill.engine_ms, copy_ms)


def _decode_limit_in_place(decoder: InPlaceDecoder, rows: list[list[int]], steps: int) -> dict[str, Any]:
    """:func:`decode_limit` on the in-place cache."""
    batch_size = len(rows)
    cache = decoder.new_cache(batch_size)
    slots = cache.take(batch_size)
    started = time.perf_counter()
    logits, prefill_ms, _ = decoder.prefill_first(cache, slots, rows)
    tokens = [int(t) for t in np.argmax(logits, axis=1)]
    decode_started = time.perf_counter()
    for _ in range(steps):
        logits, _ms = decoder.decode_slots(cache, dict(zip(slots, tokens, strict=True)))
        tokens = [int(t) for t in np.argmax(logits, axis=1)]
    return _limit_row(batch_size, steps, started, decode_started, prefill_ms, 0.0)


def _limit_row(batch_size: int, steps: int, started: float, decode_started: float, prefill_ms: float,
               relayout_ms: float) -> dict[str, Any]:  # fmt: skip
    """One :func:`decode_limit` row, the run ending now: ``started`` and ``decode_started`` are
    ``time.perf_counter()`` readings (s) at the prefill's and the first decode step's start."""
    ended = time.perf_counter()
    decode_s = ended - decode_started
    return {
        "batch_size": batch_size,
        "steps": steps,
        "tokens_per_s": batch_size * (steps + 1) / (ended - started),
        "decode_tokens_per_s": batch_size * steps / decode_s,
        "step_ms": 1000 * decode_s / steps,
        "prefill_ms": prefill_ms,
        "relayout_ms": relayout_ms,
    }


def relayout_cost(engine: Engine, prompts: Sequence[Sequence[int]], batch_size: int, steps: int,
                  repeats: int = 3) -> dict[str, Any]:  # fmt: skip
    """The price of one membership change in a running batch of the Concat cache: ``KVState.relayout``
    dropping one row and joining one new sequence, against a single copy of the resulting cache into
    preallocated arrays (the least any re-layout that moves the cache has to pay). Best of ``repeats``
    each. An engine serving the in-place cache (which moves nothing) is reopened with the Concat one."""
    if engine.kv.in_place:
        engine = Engine(engine.model_path, engine.card, ENGINE.model_copy(update={"kv_cache": "concat"}),
                        BatchingSettings(max_batch_size=batch_size), LimitSettings())  # fmt: skip
    decoder = Decoder(engine)
    state = KVState()
    prefill = decoder.prefill([list(prompts[i % len(prompts)]) for i in range(batch_size)])
    state.relayout([], prefill, list(range(batch_size)))
    tokens = [3] * batch_size
    for _ in range(steps):
        decoder.decode(state, tokens)
    joiner = decoder.prefill([list(prompts[batch_size % len(prompts)])])
    relayout_ms, copy_ms, mib = [], [], 0.0
    for _ in range(repeats):
        trial = KVState()
        trial.values, trial.mask, trial.positions = dict(state.values), state.mask, state.positions
        relayout_ms.append(trial.relayout(list(range(1, batch_size)), joiner, [0]))
        arrays = [np.asarray(v) for v in trial.values.values()]
        targets = [np.empty_like(a) for a in arrays]
        started = time.perf_counter()
        for dst, src in zip(targets, arrays, strict=True):
            np.copyto(dst, src)
        copy_ms.append(1000 * (time.perf_counter() - started))
        mib = sum(a.nbytes for a in arrays) / 2**20
    return {
        "batch_size": batch_size,
        "cache_width": int(state.mask.shape[1]),
        "cache_mib": mib,
        "relayout_ms": min(relayout_ms),
        "one_copy_ms": min(copy_ms),
        "copies": min(relayout_ms) / max(1e-9, min(copy_ms)),
    }


def loop_run(engine: Engine, work: Work, *, max_batch_size: int, continuous: bool) -> dict[str, Any]:
    """Every request of ``work`` waiting at once, served by a :class:`GenerationLoop` until all end.

    Returns tokens/s, TTFT and inter-token distributions (ms), :func:`~bench.genstats.step_shares`, and per
    request (in ``work``'s order) its tokens (``token_ids``) and time to first token (``ttft_ms``).
    """
    prefill_cap = max_batch_size * max(len(p) for p, _ in work)
    batching = BatchingSettings(
        max_batch_size=max_batch_size, max_batch_tokens=prefill_cap, continuous=continuous
    )
    loop = GenerationLoop(open_decoder(engine), batching)
    steps: list[dict[str, float]] = []

    def observe(s: GenStepStats) -> None:
        step = {k: float(v) for k, v in asdict(s).items() if k not in ("finished", "first_token_ms")}
        kv = loop.kv  # rows x cache width after the step (the whole buffer when in place)
        step["kv_slots"] = float(kv.state.mask.size if isinstance(kv, ConcatKV) else kv.cache.slots * kv.cache.capacity)
        steps.append(step)

    loop.observers.append(observe)
    started = time.monotonic()
    waiting = [
        GenSequence(request_id=str(i), prompt=list(p), arrived_s=started, eos_ids=frozenset(),
                    params=GenerationParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, stream=False))
        for i, (p, n) in enumerate(work)
    ]  # fmt: skip
    pending = list(waiting)
    while pending or loop.has_work():
        count = loop.admissible(pending)
        joiners, pending = pending[:count], pending[count:]
        loop.step(joiners)
    elapsed = time.monotonic() - started
    outcomes = [s.future.result() for s in waiting]
    tokens = sum(len(o.token_ids) for o in outcomes)
    ttft = [1000 * (o.first_token_unix_s - o.prefill_started_unix_s) + o.batch_wait_ms for o in outcomes]
    gaps = [o.mean_inter_token_ms for o in outcomes if len(o.token_ids) > 1]
    return {
        "max_batch_size": max_batch_size,
        "continuous": continuous,
        "requests": len(work),
        "tokens": tokens,
        "seconds": elapsed,
        "tokens_per_s": tokens / elapsed,
        "ttft": asdict(summarize_latencies(ttft)),
        "inter_token": asdict(summarize_latencies(gaps)),
        "shares": step_shares(steps),
        "token_ids": [list(o.token_ids) for o in outcomes],
        "ttft_ms": ttft,
    }


def _decode_feeds(card: ModelCard, names: Sequence[str], batch_size: int, past: int,
                  dtype: type[np.floating[Any]] = np.float32) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    feeds: dict[str, Any] = {
        "input_ids": rng.integers(3, card.vocab_size, size=(batch_size, 1), dtype=np.int64),
        "attention_mask": np.ones((batch_size, past + 1), dtype=np.int64),
        "position_ids": np.full((batch_size, 1), past, dtype=np.int64),
    }
    shape = (batch_size, card.kv_heads, past, card.head_dim)
    for name in names:
        if name.startswith("past_key_values."):
            feeds[name] = rng.standard_normal(shape, dtype=np.float32).astype(dtype)
    return {k: v for k, v in feeds.items() if k in names}


def concat_share(model_path: Path, card: ModelCard, *, batch_size: int, past: int, runs: int,
                 providers: Sequence[str] = ("CPUExecutionProvider",)) -> dict[str, Any]:  # fmt: skip
    """ORT's node time by operator over ``runs`` decode steps of ``batch_size`` rows at ``past`` cached
    tokens; ``concat_share`` = the ``Concat`` nodes' share (the KV cache appended into ``present``)."""
    with tempfile.TemporaryDirectory(prefix="fleet-gen-profile-") as tmp:
        def profiled() -> ort.SessionOptions:
            opts = session_options(ENGINE)
            opts.enable_profiling = True
            opts.profile_file_prefix = str(Path(tmp) / "decode")
            return opts

        sess, _steps = open_session(str(model_path), profiled, [(p, {}) for p in providers])
        feeds = _decode_feeds(card, [i.name for i in sess.get_inputs()], batch_size, past, session_kv_dtype(sess))
        for _ in range(runs):
            sess.run(None, feeds)
        events = json.loads(Path(sess.end_profiling()).read_text())
    by_op: Counter[str] = Counter()
    for ev in events:
        if ev.get("cat") == "Node" and str(ev.get("name", "")).endswith("_kernel_time"):
            by_op[str(ev.get("args", {}).get("op_name", "?"))] += int(ev.get("dur", 0))
    total = sum(by_op.values())
    shares = {op: us / total for op, us in by_op.most_common(6)} if total else {}
    return {
        "batch_size": batch_size,
        "past_tokens": past,
        "runs": runs,
        "node_ms_per_step": total / 1000 / max(1, runs),
        "concat_share": by_op.get("Concat", 0) / total if total else float("nan"),
        "top_ops": shares,
    }
