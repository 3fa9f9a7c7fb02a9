"""What ``fleet quantize`` can be asked to do: a plain dataclass, cheap to import (no onnx/ORT),
so the ``fleet`` parser can show its defaults without loading the quantization stack."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = ["CUDA_INT8_REFUSAL", "STATIC_OP_TYPES", "TARGETS", "TENSORRT_FP16_REFUSAL", "Mode", "QuantizeConfig",
           "Target", "mode_for_target"]

Mode = Literal["dynamic", "static", "fp16"]
Target = Literal["cpu", "cuda", "tensorrt"]
TARGETS: tuple[Target, ...] = ("cpu", "cuda", "tensorrt")
"""Where the model is to run: ``cpu`` (dynamic INT8 by default, as ever), ``tensorrt`` (static QDQ INT8,
symmetric: what TensorRT builds INT8 layers from), ``cuda`` (FP16; INT8 refused: :data:`CUDA_INT8_REFUSAL`)."""

CUDA_INT8_REFUSAL = (
    "--target cuda: the CUDA execution provider has no INT8 kernels for these graphs: dynamic INT8's "
    "DynamicQuantizeLinear/MatMulInteger run on the CPU with copies across the bus at every batch (measured "
    "42x slower than FP32 on an H200, docs/gpu.md), and static QDQ is dequantized into FP32 MatMuls (slower "
    "than FP32); serve the FP32 model on CUDA, convert it to FP16 for CUDA (--target cuda without --mode, or "
    "--mode fp16), or quantize for TensorRT with --target tensorrt"
)
TENSORRT_FP16_REFUSAL = (
    "--target tensorrt --mode fp16: TensorRT builds FP16 layers from the FP32 graph itself (engine.trt_fp16, on "
    "by default); serve the FP32 file there, or use --target cuda for an FP16 file the CUDA provider runs"
)
STATIC_OP_TYPES = ("MatMul", "Gather")
"""Ops static mode quantizes by default: the weight-bearing ones. The attention mask is an additive
float32-min bias, so min-max ranges on Add/Softmax activations would flatten everything else
(measured on demo-lm: top-1 agreement 0.58 with all ops, 0.96 with MatMul + Gather)."""


@dataclass(frozen=True)
class QuantizeConfig:
    """What to quantize and how; every length is in tokens."""

    mode: Mode = "dynamic"
    target: Target = "cpu"
    """Where the result is meant to run (recorded in the report; :func:`mode_for_target` picks the mode).
    ``fp16`` mode converts weights, activations and the KV cache to float16 (inputs, logits and hidden states
    stay as they were: :mod:`tools.fp16`)."""
    symmetric: bool = False
    """Signed, symmetric activations and weights (TensorRT's INT8 path); static mode only."""
    per_channel: bool = False
    calibration_path: Path | None = None
    """JSONL of token sequences; None = ``calibration_count`` seeded synthetic prompts."""
    calibration_count: int = 64
    op_types: tuple[str, ...] | None = None
    """Op types to quantize; None = ORT's defaults (dynamic) or :data:`STATIC_OP_TYPES` (static)."""
    eval_path: Path | None = None
    """Held-out JSONL prompts; None = ``eval_count`` seeded synthetic prompts (another seed)."""
    eval_count: int = 64
    min_tokens: int = 8
    max_tokens: int = 128
    seed: int = 1234
    min_top1_agreement: float = 0.8
    """Gate: refuse below this fraction of prompts with the same top-1 next token."""
    max_kl: float = 0.05
    """Gate: refuse above this mean KL(P_fp32 || P_quantized) (nats)."""
    min_cosine: float = 0.99
    """Gate for an encoder (``--mode fp16``): refuse below this smallest cosine similarity between a prompt's
    FP32 and converted mean-pooled vectors."""
    version: str | None = None
    """Version of the new file; default ``<version>-int8`` (+ ``-static``, ``-sym``), ``<version>-fp16``."""
    latency_rounds: int = 3
    latency_prompts: int = 16
    intra_op_threads: int = 0
    """ORT threads for the evaluation sessions (0 = ORT picks)."""
    overwrite: bool = False


def mode_for_target(target: Target, mode: Mode | None, symmetric: bool) -> tuple[Mode, bool]:
    """The (mode, symmetric) to quantize ``target`` with; ``mode`` None = the target's own.

    ``cpu``: ``mode`` or dynamic, ``symmetric`` as given; ``tensorrt``: static and symmetric; ``cuda``: fp16.

    Raises:
        ValueError: INT8 for ``cuda`` (:data:`CUDA_INT8_REFUSAL`), fp16 for ``tensorrt``
            (:data:`TENSORRT_FP16_REFUSAL`), ``symmetric`` outside static mode, or a ``mode`` the target
            cannot run well.
    """
    if mode == "fp16" or (target == "cuda" and mode is None):
        if target == "tensorrt":
            raise ValueError(TENSORRT_FP16_REFUSAL)
        if symmetric:
            raise ValueError("--symmetric applies to static QDQ INT8 (--mode static), not to --mode fp16")
        return "fp16", False
    if target == "cuda":
        raise ValueError(CUDA_INT8_REFUSAL)
    if target == "tensorrt":
        if mode == "dynamic":
            raise ValueError(
                "--target tensorrt quantizes static QDQ, symmetric (TensorRT builds no INT8 layers from dynamic "
                "INT8); drop --mode dynamic, or use --target cpu for dynamic INT8"
            )
        return "static", True
    return mode or "dynamic", symmetric
