"""The probe a worker runs before it serves a token from an in-place cache.

The rewritten graph (:mod:`tools.inplace_kv`) is matched structurally; this check is what makes it
safe: the same token sequences go through the in-place decoder (a first-prompt prefill of three rows
of different lengths into consecutive slots, a prompt continued in one slot, decode steps with a slot
freed in the middle of the span) and through the original graph, one whole sequence at a time with no
cache at all, and every next-token logit row must agree within ``tolerance``. It takes a few dozen
small calls (the probe's slots are 32 tokens long).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import onnxruntime as ort

from protocol.errors import ModelLoadError
from workers.engine import Engine
from workers.generation.decoder import Decoder
from workers.generation.inplace_decoder import InPlaceDecoder

__all__ = ["PROBE_TOLERANCE", "InPlaceMismatch", "open_decoder", "probe_inplace", "probe_tolerance"]

log = logging.getLogger("fleet.engine")

PROBE_CAPACITY = 32
"""Tokens per slot of the probe's own cache."""
PROBE_TOLERANCE = 1e-4
"""Largest relative logit difference the probe accepts for a float32 cache (float32 rewrites give about 1e-6)."""
FP16_PROBE_TOLERANCE = 1e-2
"""The same for a float16 graph: the rewritten attention and the original round float16 intermediates at
different points, so they differ by a few float16 ulps (float16's ulp at 1 is 1e-3; measured: the demo Llama
3e-4, optimum's GPT-2 3e-4 and Llama 1.8e-3). A rewrite that is wrong differs by the logits themselves."""


def probe_tolerance(dtype: type[np.floating[Any]]) -> float:
    """The probe's tolerance for a cache of ``dtype`` (float16: :data:`FP16_PROBE_TOLERANCE`)."""
    return FP16_PROBE_TOLERANCE if np.dtype(dtype) == np.float16 else PROBE_TOLERANCE


class InPlaceMismatch(ModelLoadError):
    """The in-place graph's probe disagrees with the original graph, or could not run (``engine.kv_cache: auto``
    then serves the Concat cache: :func:`workers.engines._decoder`)."""


def open_decoder(engine: Engine) -> Decoder:
    """The generation decoder for ``engine``: an :class:`InPlaceDecoder` when it serves the in-place graph
    (after the probe agrees), a :class:`Decoder` otherwise.

    Raises:
        InPlaceMismatch: the probe's relative error is over :func:`probe_tolerance` of the cache's type, or the
            decoder or its probe raised (the message names the exception).
    """
    if not engine.kv.in_place:
        return Decoder(engine)
    try:
        decoder = InPlaceDecoder(engine)
        error = _probe_fixed_steps(decoder, engine) if decoder.fixed_steps else probe_inplace(decoder,
                                                                                             engine.concat_source)
    except Exception as exc:  # ORT's own errors (a device's kernel or allocation) as much as ours
        raise InPlaceMismatch(f"the in-place decoder could not run its probe: {type(exc).__name__}: {exc}",
                              "engine.kv_cache", "in_place") from exc
    tolerance = probe_tolerance(decoder.kv_dtype)
    if error > tolerance:
        raise InPlaceMismatch(f"the in-place graph's probe differs from the original by {error:.1e} "
                              f"(relative; tolerance {tolerance:.0e} for a {np.dtype(decoder.kv_dtype).name} "
                              "cache)", "engine.kv_cache", "in_place")
    decoder.probe_error = error
    return decoder


def _probe_fixed_steps(decoder: InPlaceDecoder, engine: Engine) -> float:
    """The probe with the decode steps as CUDA graphs; when that raises or disagrees, the probe again with
    steps run one kernel at a time (logged, and named in ``engine.cuda_graph_reason``)."""
    try:
        error = probe_inplace(decoder, engine.concat_source)
        if error <= probe_tolerance(decoder.kv_dtype):
            return error
        why = f"its probe differs from the original graph by {error:.1e} (relative)"
    except Exception as exc:  # a capture ONNX Runtime or the driver refuses at the first steps
        why = f"its probe raised {type(exc).__name__}: {exc}"
    decoder.fixed_steps = False
    engine.cuda_graph_reason = f"decode steps as CUDA graphs: {why}"
    log.warning("model %s %s: decode steps run without CUDA graphs: %s", engine.card.name, engine.card.version,
                engine.cuda_graph_reason)
    return probe_inplace(decoder, engine.concat_source)


def _reference(session: ort.InferenceSession, names: set[str], past_names: list[str], kv_heads: int,
               head_dim: int, dtype: type[np.floating[Any]], tokens: list[int]) -> np.ndarray:
    """Next-token logits after ``tokens`` from the original graph, computed from scratch (no cache)."""
    count = len(tokens)
    feeds = {"input_ids": np.asarray([tokens], dtype=np.int64)}
    if "attention_mask" in names:
        feeds["attention_mask"] = np.ones((1, count), dtype=np.int64)
    if "position_ids" in names:
        feeds["position_ids"] = np.arange(count, dtype=np.int64)[None, :]
    for name in past_names:
        feeds[name] = np.zeros((1, kv_heads, 0, head_dim), dtype=dtype)
    (logits,) = session.run(["logits"], feeds)
    return np.asarray(logits[0, -1], dtype=np.float32)


def probe_inplace(decoder: InPlaceDecoder, original: str | bytes, *, seed: int = 0) -> float:
    """Largest |logit difference| between the in-place decoder and ``original`` over the probe, divided by
    the largest |logit| (a relative error; float32 rewrites give about 1e-6)."""
    card = decoder.engine.card
    session = ort.InferenceSession(original, providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    rng = np.random.default_rng(seed)
    high = min(card.vocab_size, 250)
    seqs = [[int(t) for t in rng.integers(3, high, size=14)] for _ in range(3)]
    cache = decoder.slot_cache(3, PROBE_CAPACITY)
    cache.take(3)
    done = [5, 2, 9]
    pairs: list[tuple[np.ndarray, np.ndarray]] = []

    def expect(row: int, got: np.ndarray) -> None:
        want = _reference(session, names, decoder.past_names, card.kv_heads, card.head_dim, decoder.kv_dtype,
                          seqs[row][: done[row]])
        pairs.append((got, want))

    logits, _ms, _padded = decoder.prefill_first(cache, [0, 1, 2], [s[:n] for s, n in zip(seqs, done, strict=True)])
    for row in range(3):
        expect(row, logits[row])
    got, _ms = decoder.prefill_after(cache, 1, seqs[1][2:5])
    done[1] = 5
    expect(1, got)
    for step in range(3):
        live = [row for row in range(3) if cache.taken(row)]
        logits, _ms = decoder.decode_slots(cache, {row: seqs[row][done[row]] for row in live})
        for row in live:
            done[row] += 1
            expect(row, logits[row])
        if step == 0:
            cache.release(1)  # a hole in the middle of the span
    scale = max(float(np.abs(w).max()) for _, w in pairs) or 1.0
    return max(float(np.abs(g - w).max()) for g, w in pairs) / scale
