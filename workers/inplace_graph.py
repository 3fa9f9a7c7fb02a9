"""Which KV cache a causal LM is served with: the graph's own ``Concat`` cache or the in-place one.

:func:`inplace_source` applies :func:`tools.inplace_kv.rewrite_inplace_kv` to the graph the worker
serves (after the LM-head-last rewrite) when ``engine.kv_cache`` allows it; the generation loop then
checks the result against the original on a probe (:mod:`workers.generation.inplace_check`) before
it serves a token.

Providers: on the CPU provider ``GroupQueryAttention`` runs float32 and float16, and the slots are host
memory. A chain with a GPU provider gets the in-place cache only for a float16 graph (the CUDA kernel
takes float16/bfloat16: ``fleet quantize --target cuda`` writes one) and with the CUDA provider in it
(TensorRT does not run ``GroupQueryAttention``); its slots are then device memory. Otherwise the chain
keeps the ``Concat`` cache, with the reason logged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from protocol.errors import ModelLoadError
from protocol.modelcard import ModelCard
from protocol.settings import EngineSettings
from store.files import read_onnx
from workers.kv_dtype import graph_kv_dtype

__all__ = ["KVChoice", "inplace_source"]

log = logging.getLogger("fleet.engine")


@dataclass(frozen=True)
class KVChoice:
    """The graph to open and the cache it gets."""

    source: str | bytes
    """Path or serialized graph for the session."""
    in_place: bool
    reason: str
    """Why this cache (logged at load, shown by the bench)."""


def _load(source: str | bytes) -> onnx.ModelProto:
    return onnx.load_from_string(source) if isinstance(source, bytes) else read_onnx(Path(source))


def inplace_source(source: str | bytes, engine: EngineSettings, card: ModelCard, providers: list[str]) -> KVChoice:
    """The graph to serve for ``source`` (a causal LM's served graph) under ``engine.kv_cache``.

    Raises:
        ModelLoadError: ``kv_cache: in_place`` and the rewrite does not apply (the message says why).
    """
    if card.kind != "causal_lm" or engine.kv_cache == "concat":
        return KVChoice(source, False, "engine.kv_cache is concat" if card.kind == "causal_lm" else "not a causal LM")
    from tools.inplace_kv import has_inplace_attention, rewrite_inplace_kv

    reason = ""
    gpu = [p for p in providers if p != "CPUExecutionProvider"]
    if gpu and "CUDAExecutionProvider" not in providers:
        reason = f"providers {providers}: on a GPU the in-place cache needs the CUDA provider (GroupQueryAttention)"
    else:
        try:
            model = _load(source)
            if gpu and graph_kv_dtype(model) is not np.float16:
                reason = (f"providers {providers}: GroupQueryAttention's CUDA kernel takes a float16 KV cache and "
                          "this graph's is float32 (fleet quantize --target cuda writes a float16 file)")
            elif any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer):
                reason = "the weights are in external data"
            elif has_inplace_attention(model):
                return KVChoice(source, True, "the graph's attention is GroupQueryAttention already")
            else:
                rewritten = rewrite_inplace_kv(model, num_heads=card.num_heads, kv_heads=card.kv_heads,
                                               head_dim=card.head_dim)
                return KVChoice(rewritten.SerializeToString(), True, "attention rewritten to GroupQueryAttention")
        except (ValueError, onnx.checker.ValidationError) as exc:
            reason = f"the rewrite does not apply: {exc}"
    if engine.kv_cache == "in_place":
        raise ModelLoadError(f"engine.kv_cache is in_place but {reason}", "engine.kv_cache", "in_place")
    log.info("model %s %s keeps the Concat KV cache: %s", card.name, card.version, reason)
    return KVChoice(source, False, reason)

