"""What an engine's ONNX Runtime session is opened with: options, provider chain, served graph.

* :func:`session_options`: SessionOptions from ``engine.*`` settings (optimisation level, thread
  counts, spin-waiting: off, ORT's own, or bounded to ``spin_duration_us`` µs after each run).
* :func:`provider_chain`: the (provider, options) list, filtered to this ORT build; TensorRT gets
  optimisation profiles from ``max_batch_size`` x ``max_input_tokens`` (tokens) so its engine builds
  at session creation.
* :func:`serving_graph`: the graph served for a model file (the LM head after a gather of the last
  position where ``engine.lm_head_last`` applies).
* :func:`graph_input_names`, :func:`check_single_ort_build`: the graph's inputs and the ORT build.

The session itself is opened by :class:`workers.engine.Engine` (one step of the chain at a time:
:mod:`workers.ort_session`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import onnx
import onnxruntime as ort

from protocol.modelcard import ModelCard
from protocol.settings import BatchingSettings, EngineSettings, LimitSettings
from store.files import read_onnx
from workers.ort_session import imported_ort_build

__all__ = ["check_single_ort_build", "graph_input_names", "provider_chain", "serving_graph", "session_options"]

log = logging.getLogger("fleet.engine")

_OPT_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


def check_single_ort_build() -> str:
    """The ONNX Runtime build this process imported (package, version, folder, providers).

    Named from the imported module's own files, not from distribution metadata (see
    ``workers.ort_session.imported_ort_build``).

    Raises:
        ConfigError: the imported module mixes files of two builds.
    """
    return imported_ort_build()


def session_options(engine: EngineSettings) -> ort.SessionOptions:
    """SessionOptions from settings (optimisation level, thread counts, spin-waiting: off, ORT's own, or bounded
    to ``spin_duration_us`` after each run)."""
    opts = ort.SessionOptions()
    opts.graph_optimization_level = _OPT_LEVELS[engine.graph_optimization_level]
    opts.intra_op_num_threads = engine.intra_op_threads
    opts.inter_op_num_threads = engine.inter_op_threads
    spin = "0" if engine.allow_spinning is False else "1"
    opts.add_session_config_entry("session.intra_op.allow_spinning", spin)
    opts.add_session_config_entry("session.inter_op.allow_spinning", spin)
    if engine.allow_spinning == "bounded":
        bound = str(engine.spin_duration_us)
        opts.add_session_config_entry("session.intra_op.spin_duration_us", bound)
        opts.add_session_config_entry("session.inter_op.spin_duration_us", bound)
    opts.log_severity_level = 3
    return opts


def graph_input_names(model_path: Path) -> list[str]:
    """Input names of the ONNX graph, read without loading weights (for TensorRT profiles)."""
    graph = read_onnx(model_path).graph
    initializers = {init.name for init in graph.initializer}
    return [i.name for i in graph.input if i.name not in initializers]


def _profile(shapes: dict[str, tuple[int, ...]]) -> str:
    return ",".join(f"{name}:{'x'.join(str(d) for d in dims)}" for name, dims in shapes.items())


def _trt_shapes(
    input_names: list[str], card: ModelCard, batch: int, tokens: int, past: int = 0
) -> dict[str, tuple[int, ...]]:
    """One TensorRT profile point: ``tokens`` new tokens per row over ``past`` cached ones."""
    out: dict[str, tuple[int, ...]] = {}
    for name in input_names:
        if name.startswith("past_key_values."):
            out[name] = (batch, card.kv_heads, past, card.head_dim)
        elif name == "attention_mask":
            out[name] = (batch, past + tokens)
        else:
            out[name] = (batch, tokens)
    return out


def provider_chain(
    engine: EngineSettings,
    batching: BatchingSettings,
    limits: LimitSettings,
    card: ModelCard,
    input_names: list[str],
    available: list[str] | None = None,
) -> list[tuple[str, dict[str, Any]]]:
    """The (provider, options) list to create the session with, filtered to what this ORT build has.

    TensorRT gets explicit optimisation profiles from ``max_batch_size`` x ``max_input_tokens`` so
    its engine builds at session creation (never mid-traffic), plus engine and timing caches. A model
    with a KV cache also gets the decode range: a past of up to ``max_input_tokens + max_new_tokens``.
    """
    have = available if available is not None else ort.get_available_providers()
    chain: list[tuple[str, dict[str, Any]]] = []
    for name in engine.providers:
        if name not in have:
            log.warning("execution provider %s is not in this onnxruntime build (%s); skipping", name, have)
            continue
        options: dict[str, Any] = {}
        if name == "TensorrtExecutionProvider":
            cache = str(engine.cache_dir / card.name / card.version)
            half = max(1, limits.max_input_tokens // 2)
            has_past = any(n.startswith("past_key_values.") for n in input_names)
            max_past = limits.max_input_tokens + limits.max_new_tokens if has_past else 0
            options = {
                "trt_fp16_enable": engine.trt_fp16,
                "trt_int8_enable": engine.trt_int8,
                "trt_engine_cache_enable": True,
                "trt_engine_cache_path": cache,
                "trt_timing_cache_enable": True,
                "trt_timing_cache_path": cache,
                "trt_profile_min_shapes": _profile(_trt_shapes(input_names, card, 1, 1)),
                "trt_profile_opt_shapes": _profile(
                    _trt_shapes(input_names, card, batching.max_batch_size, half, max_past // 2)
                ),
                "trt_profile_max_shapes": _profile(
                    _trt_shapes(input_names, card, batching.max_batch_size, limits.max_input_tokens, max_past)
                ),
            }
        options.update(engine.provider_options.get(name, {}))
        chain.append((name, options))
    if not chain:
        chain.append(("CPUExecutionProvider", {}))
    return chain


def serving_graph(model_path: Path, engine: EngineSettings, card: ModelCard) -> tuple[str | bytes, bool]:
    """The graph a worker serves for ``model_path``, and whether its logits are at the last position only.

    With ``engine.lm_head_last`` a causal LM's head moves after a gather of the last position
    (tools/lm_head_last.py, FP32 or INT8; the graph as bytes); the path itself when the rewrite does
    not apply (external data, or no LM head op behind ``logits``). The bench's limit loads the same graph.

    Raises:
        ModelLoadError: ``model_path`` is not a readable ONNX model (names the file).
    """
    if not (engine.lm_head_last and card.kind == "causal_lm"):
        return str(model_path), False
    from tools.lm_head_last import rewrite_lm_head_last

    model = read_onnx(model_path)
    try:
        if any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer):
            log.info("lm_head_last: %s keeps its weights in external data; serving the graph as it is", model_path)
            return str(model_path), False
        rewritten: bytes = rewrite_lm_head_last(model).SerializeToString()
    except (ValueError, onnx.checker.ValidationError) as exc:
        log.info("lm_head_last does not apply to %s (%s); logits at every position", model_path, exc)
        return str(model_path), False
    return rewritten, True
