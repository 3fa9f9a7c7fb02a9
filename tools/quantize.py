"""``fleet quantize``: INT8 post-training quantization, or an FP16 conversion, with an accuracy report and a gate.

Three modes, all through ONNX Runtime's own tools (the INT8 ones after ``quant_pre_process``):

* ``dynamic`` — INT8 weights, activations quantized on the fly (``quantize_dynamic``); the
  recommended mode for transformers on CPU; needs no data.
* ``static`` — QDQ INT8 (``quantize_static``) calibrated on a set of token sequences (a JSONL
  file, or seeded synthetic prompts); ``symmetric`` makes activations and weights signed and
  symmetric, as TensorRT's INT8 path wants (``trt_int8_enable``, no calibration table);
* ``fp16`` — weights, activations and the KV cache in float16 (:mod:`tools.fp16`): what the CUDA
  provider runs fast, and what its in-place KV cache needs.

The target (``cfg.target``: ``cpu``, ``tensorrt``, ``cuda``) picks the mode (``cuda``: fp16, INT8 refused):
:func:`tools.quantize_config.mode_for_target`.

The result is a new versioned file next to the original — ``demo-lm-1.0.0.onnx`` →
``demo-lm-1.0.0-int8.onnx`` (static: ``-int8-static``, symmetric: ``-int8-static-sym``, fp16: ``-fp16``) — with its
model card (``version`` and ``quantization`` set) and a JSON report ``<stem>.report.json``: file sizes
and ratio, top-1 next-token agreement, mean KL and max |Δ log-prob| against FP32 on held-out
prompts (an encoder, ``fp16`` only: the cosine similarity of each prompt's mean-pooled vectors), and the
latency ratio measured in the same run. The gate (``min_top1_agreement``, ``max_kl``; an encoder's
``min_cosine``) refuses to write a model that falls below it: :class:`QuantizationRefused` carries the
measured figures and nothing is written.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
import onnxruntime as ort
from onnxruntime.quantization import (
    CalibrationMethod,
    QuantFormat,
    QuantType,
    quantize_dynamic,
    quantize_static,
)
from onnxruntime.quantization.shape_inference import quant_pre_process
from tqdm import tqdm

from protocol.modelcard import ModelCard, card_path_for, load_card
from store.files import read_onnx
from tools.artifacts import model_path as versioned_path
from tools.artifacts import write_atomic
from tools.calibration import (
    JsonlCalibrationReader,
    feeds_for,
    input_names,
    read_sequences,
    synthetic_sequences,
)
from tools.fp16 import convert_to_fp16
from tools.quant_accuracy import AccuracyReport, EmbeddingAccuracy, compare_embeddings, compare_logits
from workers.kv_dtype import session_kv_dtype

__all__ = [
    "STATIC_OP_TYPES",
    "QuantizationRefused",
    "QuantizeConfig",
    "QuantizeOutcome",
    "quantize_model",
    "report_path_for",
]

from tools.quantize_config import STATIC_OP_TYPES, QuantizeConfig, mode_for_target


@dataclass
class QuantizeOutcome:
    """The written model (None when refused) and the report."""

    path: Path | None
    report: dict[str, Any] = field(default_factory=dict)


class QuantizationRefused(Exception):
    """The quantized model fell below the accuracy gate; nothing was written."""

    def __init__(self, message: str, report: dict[str, Any]) -> None:
        super().__init__(message)
        self.report = report


def label_for(cfg: QuantizeConfig) -> str:
    """The card's ``quantization`` value, e.g. ``int8-dynamic``, ``int8-static-qdq-symmetric`` or ``fp16``."""
    if cfg.mode == "fp16":
        return "fp16"
    if cfg.mode == "dynamic":
        return "int8-dynamic" + ("-per-channel" if cfg.per_channel else "")
    return (
        "int8-static-qdq"
        + ("-symmetric" if cfg.symmetric else "")
        + ("-per-channel" if cfg.per_channel else "")
    )


def default_version(base: str, cfg: QuantizeConfig) -> str:
    """``1.0.0`` → ``1.0.0-int8`` (dynamic), ``1.0.0-int8-static``, ``1.0.0-int8-static-sym``, ``1.0.0-fp16``."""
    if cfg.mode == "fp16":
        return f"{base}-fp16"
    if cfg.mode == "dynamic":
        return f"{base}-int8"
    return f"{base}-int8-static" + ("-sym" if cfg.symmetric else "")


def report_path_for(model_file: Path) -> Path:
    """``x/demo-lm-1.0.0-int8.onnx`` → ``x/demo-lm-1.0.0-int8.report.json``."""
    return model_file.with_name(model_file.stem + ".report.json")


def _say(msg: str, progress: bool) -> None:
    if progress:
        print(f"[quantize] {msg}", file=sys.stderr, flush=True)


def _session(path: Path, threads: int) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = threads
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")  # as a worker runs it
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def _quantize(src: Path, dst: Path, card: ModelCard, cfg: QuantizeConfig, progress: bool) -> dict[str, Any]:
    """Write the INT8 (or FP16) model of ``src`` to ``dst``; returns the calibration (conversion) facts for the
    report."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # ORT's quantizer logs a pre-processing hint per call (on the root logger)
    try:
        return _run_quantizer(src, dst, card, cfg, progress)
    finally:  # the process's own logging (a worker's, a test's) as it was
        root.setLevel(level)


def _run_quantizer(src: Path, dst: Path, card: ModelCard, cfg: QuantizeConfig, progress: bool) -> dict[str, Any]:
    if cfg.mode == "fp16":
        return convert_to_fp16(src, dst)
    if cfg.mode == "dynamic":
        ops = list(cfg.op_types) if cfg.op_types else None
        quantize_dynamic(
            src, dst, weight_type=QuantType.QInt8, per_channel=cfg.per_channel, op_types_to_quantize=ops
        )
        return {"source": None, "sequences": 0, "op_types": ops}
    if cfg.calibration_path is not None:
        seqs = read_sequences(cfg.calibration_path, vocab_size=card.vocab_size, max_tokens=card.max_positions)
        source = str(cfg.calibration_path)
    else:
        seqs = synthetic_sequences(
            cfg.calibration_count,
            vocab_size=card.vocab_size,
            min_tokens=cfg.min_tokens,
            max_tokens=min(cfg.max_tokens, card.max_positions),
            seed=cfg.seed,
        )
        source = f"synthetic (seed {cfg.seed})"
    reader = JsonlCalibrationReader(input_names(src), card, seqs)
    ops = list(cfg.op_types or STATIC_OP_TYPES)
    _say(f"calibrating on {len(seqs)} sequences (min-max) and writing QDQ INT8 for {ops}", progress)
    activation = QuantType.QInt8 if cfg.symmetric else QuantType.QUInt8
    quantize_static(
        src,
        dst,
        reader,
        quant_format=QuantFormat.QDQ,
        activation_type=activation,
        weight_type=QuantType.QInt8,
        per_channel=cfg.per_channel,
        op_types_to_quantize=ops,
        calibrate_method=CalibrationMethod.MinMax,
        extra_options={"ActivationSymmetric": cfg.symmetric, "WeightSymmetric": True},
    )
    return {"source": source, "sequences": len(seqs), "method": "minmax", "op_types": ops}


def _inputs(sess: ort.InferenceSession) -> tuple[list[str], type[np.floating[Any]]]:
    """The session's input names and its KV cache's element type (float32, or float16 after ``--mode fp16``)."""
    return [i.name for i in sess.get_inputs()], session_kv_dtype(sess)


def _output_of(card: ModelCard) -> str:
    """The graph output the report reads: an encoder's ``last_hidden_state``, a causal LM's ``logits``."""
    return "last_hidden_state" if card.kind == "encoder" else "logits"


def _per_prompt(
    sess: ort.InferenceSession, card: ModelCard, prompts: list[list[int]], desc: str, progress: bool
) -> npt.NDArray[np.float32]:
    """One row per prompt (one prompt per run: no padding): a causal LM's logits at its last token, an
    encoder's ``last_hidden_state`` averaged over its tokens."""
    names, dtype = _inputs(sess)
    encoder = card.kind == "encoder"
    output = _output_of(card)
    rows = []
    for seq in tqdm(prompts, desc=desc, unit="prompt", disable=not progress, leave=False):
        (out,) = sess.run([output], feeds_for(names, card, [seq], kv_dtype=dtype))
        array = np.asarray(out, dtype=np.float32)
        # a last-position-only LM head gives one position
        rows.append(array[0].mean(axis=0) if encoder else array[0, min(len(seq), array.shape[1]) - 1])
    return np.stack(rows)


def _latency(
    ref: ort.InferenceSession,
    cand: ort.InferenceSession,
    card: ModelCard,
    prompts: list[list[int]],
    rounds: int,
    progress: bool,
    short: str,
) -> dict[str, float | int]:
    """Mean ms per prompt of each session, runs interleaved so both see the same machine load (the candidate's
    figure is keyed ``<short>_ms``: ``int8_ms``, ``fp16_ms``)."""
    sessions = {"fp32": ref, short: cand}
    output = _output_of(card)
    feeds = {name: [feeds_for(names, card, [p], kv_dtype=dtype) for p in prompts]
             for name, (names, dtype) in ((name, _inputs(sess)) for name, sess in sessions.items())}
    spent = dict.fromkeys(sessions, 0.0)
    for i in range(min(2, len(prompts))):  # warm both (first runs allocate)
        for name, sess in sessions.items():
            sess.run([output], feeds[name][i])
    for _ in tqdm(range(rounds), desc="latency", unit="round", disable=not progress, leave=False):
        for i in range(len(prompts)):
            for name, sess in sessions.items():
                start = time.perf_counter()
                sess.run([output], feeds[name][i])
                spent[name] += time.perf_counter() - start
    runs = max(1, rounds * len(prompts))
    fp32_ms, cand_ms = 1000 * spent["fp32"] / runs, 1000 * spent[short] / runs
    return {
        "prompts": len(prompts),
        "rounds": rounds,
        "fp32_ms": round(fp32_ms, 3),
        f"{short}_ms": round(cand_ms, 3),
        "ratio": round(cand_ms / fp32_ms, 4),
        "speedup": round(fp32_ms / cand_ms, 3),
    }


def summary_of(acc: AccuracyReport | EmbeddingAccuracy) -> str:
    """The accuracy figures in one phrase (the refusal's message, the CLI's last line)."""
    if isinstance(acc, EmbeddingAccuracy):
        return (f"smallest cosine similarity {acc.min_cosine:.5f}, mean {acc.mean_cosine:.5f}, "
                f"max |Δ| {acc.max_abs_delta:.2e} of the largest value")
    return (f"top-1 agreement {acc.top1_agreement:.3f}, mean KL {acc.mean_kl:.4f} nats, "
            f"max |Δ log-prob| {acc.max_abs_delta_logprob:.3f}")


def _gate(acc: AccuracyReport | EmbeddingAccuracy, cfg: QuantizeConfig) -> list[str]:
    if isinstance(acc, EmbeddingAccuracy):
        if acc.min_cosine < cfg.min_cosine:
            return [f"smallest cosine similarity {acc.min_cosine:.5f} < min_cosine {cfg.min_cosine}"]
        return []
    failures = []
    if acc.top1_agreement < cfg.min_top1_agreement:
        failures.append(
            f"top-1 agreement {acc.top1_agreement:.3f} < min_top1_agreement {cfg.min_top1_agreement}"
        )
    if acc.mean_kl > cfg.max_kl:
        failures.append(f"mean KL {acc.mean_kl:.4f} nats > max_kl {cfg.max_kl}")
    return failures


def _eval_prompts(card: ModelCard, cfg: QuantizeConfig) -> tuple[list[list[int]], str]:
    if cfg.eval_path is not None:
        return read_sequences(cfg.eval_path, vocab_size=card.vocab_size, max_tokens=card.max_positions), str(
            cfg.eval_path
        )
    seed = cfg.seed + 1  # never the calibration prompts
    prompts = synthetic_sequences(
        cfg.eval_count,
        vocab_size=card.vocab_size,
        min_tokens=cfg.min_tokens,
        max_tokens=min(cfg.max_tokens, card.max_positions),
        seed=seed,
    )
    return prompts, f"synthetic (seed {seed})"


def _stamp(model_file: Path, card: ModelCard, dst: Path) -> None:
    """Copy ``model_file`` to ``dst`` with the new card's version in the ONNX metadata."""
    model = onnx.load(str(model_file))
    props = {p.key: p.value for p in model.metadata_props}
    props.update({"version": card.version, "quantization": card.quantization or ""})
    del model.metadata_props[:]
    for key, value in props.items():
        model.metadata_props.add(key=key, value=str(value))
    onnx.save(model, str(dst))


def quantize_model(model_file: Path, cfg: QuantizeConfig, *, progress: bool = True) -> QuantizeOutcome:
    """Quantize ``model_file`` (a causal LM with a card), measure it, gate it, write it.

    Returns:
        The new ``.onnx`` path and the report (also written as ``<stem>.report.json``).

    Raises:
        QuantizationRefused: the gate failed; ``exc.report`` holds the measured figures.
        FileExistsError: the target exists and ``cfg.overwrite`` is False.
        ValueError: not a causal LM, a source quantized already (card ``quantization``), a symmetric dynamic
            request, INT8 for ``cfg.target`` cuda or a mode ``cfg.target`` does not take
            (:func:`tools.quantize_config.mode_for_target`), INT8-only options with fp16, or a bad
            calibration/eval file.
        ModelLoadError: no model card next to ``model_file``, or it is not a readable ONNX model.
    """
    started = time.monotonic()
    card = load_card(model_file)
    read_onnx(model_file)  # a corrupt file is refused here, naming it, not deep in the quantizer
    if (card.quantization or "fp32").strip().lower() not in ("fp32", "float32", "none"):
        raise ValueError(f"{model_file.name} is {card.quantization} already (its card's quantization): quantize "
                         "the FP32 file it was made from")
    if card.kind == "encoder" and cfg.mode != "fp16":
        raise ValueError(f"{model_file}: INT8 takes causal LMs (its report compares next-token logits); an encoder "
                         "converts to FP16 (--mode fp16, or --target cuda), its report comparing the vectors")
    if card.kind not in ("causal_lm", "encoder"):
        raise ValueError(f"{model_file}: kind {card.kind} has no accuracy report (causal_lm, encoder)")
    if cfg.symmetric and cfg.mode != "static":
        raise ValueError("symmetric applies to static QDQ quantization (--mode static)")
    if cfg.mode == "fp16" and (cfg.per_channel or cfg.op_types or cfg.calibration_path):
        raise ValueError("--per-channel, --op-types and --calibration apply to INT8 modes, not to --mode fp16")
    if mode_for_target(cfg.target, cfg.mode, cfg.symmetric) != (cfg.mode, cfg.symmetric):
        raise ValueError(f"--target {cfg.target} quantizes static QDQ, symmetric (--mode static --symmetric)")
    version = cfg.version or default_version(card.version, cfg)
    target = model_file.parent / versioned_path(Path("."), card.name, version).name
    if target.exists() and not cfg.overwrite:
        raise FileExistsError(f"{target} exists; pass --overwrite to replace it")
    new_card = card.model_copy(update={"version": version, "quantization": label_for(cfg)})
    short = "fp16" if cfg.mode == "fp16" else "int8"  # the candidate in the report's keys: int8_bytes, fp16_ms…
    with tempfile.TemporaryDirectory(prefix=".quantize-", dir=model_file.parent) as tmp_dir:
        tmp = Path(tmp_dir)
        symbolic = importlib.util.find_spec("sympy") is not None
        source = model_file
        if cfg.mode != "fp16":  # the INT8 quantizers want inferred shapes; the FP16 converter infers its own
            _say(f"pre-processing {model_file.name} (symbolic shapes: {symbolic})", progress)
            quant_pre_process(str(model_file), str(tmp / "pre.onnx"), skip_symbolic_shape=not symbolic)
            source = tmp / "pre.onnx"
        _say(f"quantizing ({label_for(cfg)})", progress)
        calibration = _quantize(source, tmp / "raw.onnx", card, cfg, progress)
        _stamp(tmp / "raw.onnx", new_card, tmp / "out.onnx")
        prompts, eval_source = _eval_prompts(card, cfg)
        _say(f"comparing against FP32 on {len(prompts)} held-out prompts", progress)
        ref = _session(model_file, cfg.intra_op_threads)
        cand = _session(tmp / "out.onnx", cfg.intra_op_threads)
        acc: AccuracyReport | EmbeddingAccuracy
        compare = compare_embeddings if card.kind == "encoder" else compare_logits
        acc = compare(_per_prompt(ref, card, prompts, "fp32", progress),
                      _per_prompt(cand, card, prompts, short, progress))
        latency = _latency(ref, cand, card, prompts[: cfg.latency_prompts], cfg.latency_rounds, progress, short)
        fp32_bytes, out_bytes = model_file.stat().st_size, (tmp / "out.onnx").stat().st_size
        failures = _gate(acc, cfg)
        report: dict[str, Any] = {
            "source": str(model_file),
            "output": None if failures else str(target),
            "written": not failures,
            "name": card.name,
            "version": version,
            "quantization": label_for(cfg),
            "target": cfg.target,
            "mode": cfg.mode,
            "symmetric": cfg.symmetric,
            "per_channel": cfg.per_channel,
            "calibration": calibration,
            "sizes": {
                "fp32_bytes": fp32_bytes,
                f"{short}_bytes": out_bytes,
                "ratio": round(out_bytes / fp32_bytes, 4),
            },
            "accuracy": {**acc.as_dict(), "eval_source": eval_source},
            "latency": latency,
            "gate": {
                **({"min_cosine": cfg.min_cosine} if card.kind == "encoder"
                   else {"min_top1_agreement": cfg.min_top1_agreement, "max_kl": cfg.max_kl}),
                "passed": not failures,
                "failures": failures,
            },
            "onnxruntime": ort.__version__,
            "symbolic_shape_inference": symbolic,
            "elapsed_s": round(time.monotonic() - started, 2),
        }
        if failures:
            raise QuantizationRefused(f"refused to write {target.name}: " + "; ".join(failures)
                                      + f" (measured on {acc.prompts} prompts: {summary_of(acc)})", report)
        _say(f"writing {target}", progress)
        # the card first: whoever finds the model finds its card (tools.artifacts)
        write_atomic(card_path_for(target), (new_card.model_dump_json(indent=2) + "\n").encode())
        (tmp / "out.onnx").replace(target)  # same folder: an atomic rename
    write_atomic(report_path_for(target), (json.dumps(report, indent=2) + "\n").encode())
    return QuantizeOutcome(target, report)
