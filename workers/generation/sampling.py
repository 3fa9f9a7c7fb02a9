"""Per-request token choice (pure numpy): repetition penalty, temperature, top-k, top-p, seeded draw.

A request's :class:`Sampler` owns one ``numpy.random.Generator(seed)`` and draws exactly one number
per generated token, whatever batch the token was computed in. So a request gives the same tokens
alone, inside any batch, and after a redelivery (the model's logits for a row do not depend on the
other rows). ``temperature == 0`` is greedy: the most likely token, ties broken towards the lower id.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from protocol.messages import GenerationParams

__all__ = ["Sampler", "apply_repetition_penalty", "greedy", "greedy_rows", "nucleus_probs"]

FloatArray = npt.NDArray[np.float64]


def apply_repetition_penalty(logits: FloatArray, seen: Iterable[int], penalty: float) -> FloatArray:
    """CTRL-style penalty (as transformers applies it): seen tokens' positive logits are divided by
    ``penalty``, negative ones multiplied. Returns a new array; ``penalty == 1`` returns ``logits``."""
    if penalty == 1.0:
        return logits
    ids = np.fromiter(set(seen), dtype=np.int64)
    if ids.size == 0:
        return logits
    out = logits.copy()
    picked = out[ids]
    with np.errstate(over="ignore"):  # a tiny penalty may send a logit to +inf: the sampler takes it at its limit
        out[ids] = np.where(picked > 0, picked / penalty, picked * penalty)
    return out


def greedy(logits: FloatArray) -> int:
    """Index of the largest logit; ties go to the lowest id (``argmax`` takes the first)."""
    return int(np.argmax(logits))


def greedy_rows(logits: npt.NDArray[np.floating]) -> npt.NDArray[np.int64]:
    """:func:`greedy` of every row of ``logits`` [rows, vocab] in one call: what a sampler that
    :attr:`~Sampler.takes_argmax` picks (a float32 row and its float64 copy have the same largest entry,
    ties and NaN included, since the copy is exact)."""
    return np.asarray(np.argmax(logits, axis=-1), dtype=np.int64)


def nucleus_probs(logits: FloatArray, temperature: float, top_k: int, top_p: float) -> FloatArray:
    """Probabilities after temperature, top-k and top-p cuts (zeros outside the kept set).

    Order of operations follows transformers' default warpers: temperature, then top-k, then top-p.
    The kept set always holds at least the most likely token. A temperature so small (or a repetition
    penalty so strong) that the scaled logits leave the floats is taken at its limit: the mass goes to
    the most likely tokens, as greedy would pick, never to an arbitrary id.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        scaled = logits / temperature
    if not np.isfinite(scaled.max()):  # an overflow: the max is +inf or NaN (or -inf, when every entry is)
        scaled = _scaled_at_the_limit(logits, temperature)
    order = np.argsort(-scaled, kind="stable")
    if 0 < top_k < order.size:
        order = order[:top_k]
    kept = scaled[order]
    with np.errstate(over="ignore"):  # a spread past the floats gives -inf: probability 0, as it should
        probs = np.exp(kept - kept.max())
    probs /= probs.sum()
    if top_p < 1.0:
        cumulative = np.cumsum(probs)
        # keep the smallest prefix whose mass reaches top_p (the token that crosses it included)
        count = int(np.searchsorted(cumulative, top_p, side="left")) + 1
        order, probs = order[:count], probs[:count] / probs[:count].sum()
    out = np.zeros_like(scaled)
    out[order] = probs
    return out


def _scaled_at_the_limit(logits: FloatArray, temperature: float) -> FloatArray:
    """``logits / temperature`` shifted so that its largest entry is 0, for logits or a temperature whose plain
    quotient overflows: the largest logits end at 0, the others at most 0 (``-inf`` where the gap overflows)."""
    top = np.finfo(np.float64).max
    finite = np.nan_to_num(logits, nan=-top, posinf=top, neginf=-top)
    with np.errstate(over="ignore", invalid="ignore"):
        shifted: FloatArray = (finite - finite.max()) / temperature
    return shifted


class Sampler:
    """One request's token chooser; call :meth:`pick` once per generated token."""

    def __init__(self, params: GenerationParams) -> None:
        self.params = params
        self._rng = np.random.Generator(np.random.PCG64(params.seed or 0))

    @property
    def takes_argmax(self) -> bool:
        """True when :meth:`pick` is the row's argmax whatever the history (greedy, no repetition
        penalty): a batch's picks are then :func:`greedy_rows` of its logits, one call for all rows."""
        return self.params.temperature == 0.0 and self.params.repetition_penalty == 1.0

    def pick(self, logits: npt.NDArray[np.floating], history: Iterable[int]) -> int:
        """The next token from one row of logits [vocab]; ``history`` = prompt + generated ids so far."""
        p = self.params
        x = apply_repetition_penalty(np.asarray(logits, dtype=np.float64), history, p.repetition_penalty)
        if p.temperature == 0.0:
            return greedy(x)
        probs = nucleus_probs(x, p.temperature, p.top_k, p.top_p)
        draw = self._rng.random()
        cumulative = np.cumsum(probs)
        return int(min(np.searchsorted(cumulative, draw * cumulative[-1], side="right"), probs.size - 1))
