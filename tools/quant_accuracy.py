"""How far a quantized model's next-token distribution (or an encoder's vectors) drifts from FP32's (pure numpy).

All figures compare two ``[n, vocab]`` arrays of last-position logits, row by row:

* **top-1 agreement** — fraction of rows whose arg-max token is the same (ties → lower id);
* **mean KL divergence** ``KL(P_fp32 || P_q)`` in nats, averaged over rows;
* **max |Δ log-prob|** over the whole vocabulary, and over FP32's top-5 tokens (what a client
  gets back), in nats.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["AccuracyReport", "EmbeddingAccuracy", "compare_embeddings", "compare_logits", "log_softmax"]

FloatArray = npt.NDArray[np.floating]


@dataclass(frozen=True)
class AccuracyReport:
    """Drift of a quantized model against FP32 on a set of prompts."""

    prompts: int
    """Rows compared."""
    top1_agreement: float
    """Fraction in [0, 1] of prompts with the same most likely next token."""
    mean_kl: float
    """Mean KL(P_fp32 || P_quantized) (nats)."""
    max_abs_delta_logprob: float
    """Largest |log p_q - log p_fp32| over all prompts and the whole vocabulary (nats)."""
    max_abs_delta_logprob_top5: float
    """Largest |log p_q - log p_fp32| over FP32's top-5 tokens of every prompt (nats)."""

    def as_dict(self) -> dict[str, float | int]:
        """JSON-friendly view."""
        return asdict(self)


def log_softmax(logits: FloatArray) -> npt.NDArray[np.float64]:
    """Row-wise log-softmax in float64 (stable: the row maximum is subtracted first)."""
    x = np.asarray(logits, dtype=np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    out: npt.NDArray[np.float64] = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    return out


def compare_logits(reference: FloatArray, candidate: FloatArray, top: int = 5) -> AccuracyReport:
    """Compare ``candidate`` logits to ``reference`` (both ``[n, vocab]``, same prompts in order).

    Raises:
        ValueError: the shapes differ, are not 2-D, or hold no rows.
    """
    ref = np.asarray(reference)
    cand = np.asarray(candidate)
    if ref.shape != cand.shape or ref.ndim != 2 or ref.shape[0] == 0:
        raise ValueError(f"need two equal [n, vocab] arrays with n >= 1, got {ref.shape} and {cand.shape}")
    lp_ref = log_softmax(ref)
    lp_cand = log_softmax(cand)
    agree = float(np.mean(np.argmax(lp_ref, axis=-1) == np.argmax(lp_cand, axis=-1)))
    kl_rows = np.sum(np.exp(lp_ref) * (lp_ref - lp_cand), axis=-1)
    delta = np.abs(lp_cand - lp_ref)
    k = min(top, ref.shape[1])
    top_ids = np.argsort(-lp_ref, axis=-1, kind="stable")[:, :k]
    return AccuracyReport(
        prompts=int(ref.shape[0]),
        top1_agreement=agree,
        mean_kl=float(max(0.0, float(np.mean(kl_rows)))),
        max_abs_delta_logprob=float(delta.max()),
        max_abs_delta_logprob_top5=float(np.take_along_axis(delta, top_ids, axis=-1).max()),
    )


@dataclass(frozen=True)
class EmbeddingAccuracy:
    """Drift of an encoder's converted copy against FP32: mean-pooled token vectors, prompt by prompt."""

    prompts: int
    """Rows compared."""
    min_cosine: float
    """Smallest cosine similarity between a prompt's two vectors (1 = the same direction)."""
    mean_cosine: float
    max_abs_delta: float
    """Largest |candidate - reference| over every prompt and dimension, divided by the largest |reference|."""

    def as_dict(self) -> dict[str, float | int]:
        """JSON-friendly view."""
        return asdict(self)


def compare_embeddings(reference: FloatArray, candidate: FloatArray) -> EmbeddingAccuracy:
    """Compare ``candidate`` vectors to ``reference`` (both ``[n, dim]``, same prompts in order).

    Raises:
        ValueError: the shapes differ, are not 2-D, or hold no rows.
    """
    ref = np.asarray(reference, dtype=np.float64)
    cand = np.asarray(candidate, dtype=np.float64)
    if ref.shape != cand.shape or ref.ndim != 2 or ref.shape[0] == 0:
        raise ValueError(f"need two equal [n, dim] arrays with n >= 1, got {ref.shape} and {cand.shape}")
    norms = np.linalg.norm(ref, axis=1) * np.linalg.norm(cand, axis=1)
    cosine = np.where(norms > 0, np.sum(ref * cand, axis=1) / np.where(norms > 0, norms, 1.0), 1.0)
    scale = float(np.abs(ref).max()) or 1.0
    return EmbeddingAccuracy(prompts=int(ref.shape[0]), min_cosine=float(cosine.min()),
                             mean_cosine=float(cosine.mean()), max_abs_delta=float(np.abs(cand - ref).max()) / scale)
