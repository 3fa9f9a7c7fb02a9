"""What ``fleet quantize`` can be asked to do: a plain dataclass, cheap to import (no onnx/ORT),
so the ``fleet`` parser can show its defaults without loading the quantization stack."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = ["STATIC_OP_TYPES", "Mode", "QuantizeConfig"]

Mode = Literal["dynamic", "static"]
STATIC_OP_TYPES = ("MatMul", "Gather")
"""Ops static mode quantizes by default: the weight-bearing ones. The attention mask is an additive
float32-min bias, so min-max ranges on Add/Softmax activations would flatten everything else
(measured on demo-lm: top-1 agreement 0.58 with all ops, 0.96 with MatMul + Gather)."""


@dataclass(frozen=True)
class QuantizeConfig:
    """What to quantize and how; every length is in tokens."""

    mode: Mode = "dynamic"
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
    """Gate: refuse above this mean KL(P_fp32 || P_int8) (nats)."""
    version: str | None = None
    """Version of the new file; default ``<version>-int8`` (+ ``-static``, ``-sym``)."""
    latency_rounds: int = 3
    latency_prompts: int = 16
    intra_op_threads: int = 0
    """ORT threads for the evaluation sessions (0 = ORT picks)."""
    overwrite: bool = False
