"""Sampling at the edges of what a request may ask: a temperature or a repetition penalty so small that the
scaled logits overflow must still pick one of the most likely tokens (the limit of the distribution), never an
arbitrary id, and must not raise (pytest turns numpy's overflow warnings into errors)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.messages import GenerationParams
from workers.generation.sampling import Sampler, nucleus_probs

ROWS = st.lists(st.floats(-30.0, 30.0, width=32), min_size=2, max_size=40)
TINY = st.sampled_from([5e-324, 1e-320, 1e-310, 2.2e-308, 1e-300])


@settings(max_examples=200, deadline=None)
@given(row=ROWS, temperature=TINY, seed=st.integers(0, 2**32), top_k=st.integers(0, 50))
def test_a_vanishing_temperature_samples_only_the_most_likely_tokens(
    row: list[float], temperature: float, seed: int, top_k: int
) -> None:
    logits = np.asarray(row, dtype=np.float32)
    best = set(np.flatnonzero(logits == logits.max()).tolist())
    sampler = Sampler(GenerationParams(temperature=temperature, top_k=top_k, seed=seed))
    picks = {sampler.pick(logits, []) for _ in range(4)}
    assert picks <= best, (picks, best)


@pytest.mark.parametrize("temperature", [5e-324, 1e-310, 1e-300, 0.5])
def test_the_probabilities_stay_a_distribution_over_the_best_tokens(temperature: float) -> None:
    logits = np.array([-1.0, -0.5, -2.0, -0.5, -3.0])
    probs = nucleus_probs(logits, temperature, 0, 1.0)
    assert np.isfinite(probs).all() and probs.sum() == pytest.approx(1.0)
    if temperature < 1e-100:
        assert probs.tolist() == [0.0, 0.5, 0.0, 0.5, 0.0]


@settings(max_examples=100, deadline=None)
@given(row=ROWS, seed=st.integers(0, 2**32), temperature=st.sampled_from([0.0, 1.0, 100.0]))
def test_a_vanishing_repetition_penalty_favours_a_seen_token(row: list[float], seed: int, temperature: float) -> None:
    """A penalty below 1 raises the seen tokens' positive logits; at 1e-308 they overflow to +inf, and the
    pick must be one of them (before: NaN probabilities, and the last id of the vocabulary)."""
    logits = np.asarray(row, dtype=np.float32)
    seen = [int(i) for i in np.flatnonzero(logits > 0)[:3]]
    if not seen:
        return
    params = GenerationParams(temperature=temperature, repetition_penalty=1e-308, seed=seed)
    picks = {Sampler(params).pick(logits, seen) for _ in range(3)}
    assert picks <= set(seen)
