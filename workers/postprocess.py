"""Turning raw model outputs into small per-request results (pure numpy).

Full logits are never stored: one 128-token request over an 8k vocabulary is 4 MiB of float32.
Results are top-k log-probabilities or one pooled vector per request.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from protocol.pooling import Pooling, PoolingMode

__all__ = ["last_positions", "pool", "top_k_logprobs"]

FloatArray = npt.NDArray[np.float32]


def last_positions(logits: FloatArray, lengths: npt.NDArray[np.int64]) -> FloatArray:
    """[batch, seq, vocab] logits → [batch, vocab] at each row's last real position.

    A model rewritten to compute the LM head only at the last position (``tools/lm_head_last.py``)
    returns [batch, 1, vocab]; the index is clipped so such a model is served the same way.
    """
    rows = np.arange(logits.shape[0])
    return np.asarray(logits[rows, np.minimum(lengths, logits.shape[1]) - 1, :], dtype=np.float32)


def top_k_logprobs(last_logits: FloatArray, k: int) -> tuple[npt.NDArray[np.int64], FloatArray]:
    """Top-``k`` token ids and their log-probabilities for each row of ``last_logits`` [batch, vocab].

    Ties break towards the lower token id, so results are deterministic. Returns ([batch, k] ids,
    [batch, k] log-probs), best first.
    """
    k = min(k, last_logits.shape[-1])
    x = last_logits.astype(np.float64)
    peak = x.max(axis=-1, keepdims=True)
    logprobs = x - peak - np.log(np.exp(x - peak).sum(axis=-1, keepdims=True))
    # stable sort on negated values keeps lower ids first among equal log-probs
    order = np.argsort(-logprobs, axis=-1, kind="stable")[:, :k]
    picked = np.take_along_axis(logprobs, order, axis=-1)
    return order.astype(np.int64), picked.astype(np.float32)


def _pool_one(hidden: FloatArray, mask: FloatArray, mode: PoolingMode) -> FloatArray:
    """One sentence-transformers pooling mode over [batch, seq, dim] with ``mask`` [batch, seq, 1]."""
    if mode == "cls":
        return hidden[:, 0, :]
    if mode == "max":  # pads must never win: sentence-transformers sets them to -1e9 first
        return np.asarray(np.where(mask > 0, hidden, np.float32(-1e9)).max(axis=1), dtype=np.float32)
    if mode == "lasttoken":  # the last real token of each row, wherever the padding is
        width = mask.shape[1]
        last = width - 1 - np.argmax(mask[:, ::-1, 0], axis=1)
        return hidden[np.arange(hidden.shape[0]), last, :]
    if mode == "weightedmean":  # position i (from 1) weighs i
        mask = mask * np.arange(1, mask.shape[1] + 1, dtype=np.float32)[None, :, None]
    summed = (hidden * mask).sum(axis=1)
    counts = np.clip(mask.sum(axis=1), 1e-9, None)
    return np.asarray(summed / (np.sqrt(counts) if mode == "mean_sqrt_len" else counts), dtype=np.float32)


def pool(hidden: FloatArray, attention_mask: npt.NDArray[np.int64], pooling: Pooling) -> FloatArray:
    """[batch, seq, dim] token vectors → [batch, dim x len(modes)] sentence vectors as ``pooling``
    declares (modes concatenated in order; L2-normalised per row when the model normalises), as
    sentence-transformers computes them."""
    mask = attention_mask[:, :, None].astype(np.float32)
    pooled = np.concatenate([_pool_one(hidden, mask, mode) for mode in pooling.modes], axis=-1)
    if pooling.normalize:
        pooled = pooled / np.clip(np.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12, None)
    return np.asarray(pooled, dtype=np.float32)
