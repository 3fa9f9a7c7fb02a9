"""Padding and post-processing (pure numpy)."""

from __future__ import annotations

import numpy as np
import pytest

from protocol.pooling import Pooling
from workers.padding import pad_batch
from workers.postprocess import last_positions, pool, top_k_logprobs


def test_pad_batch_right_pads_with_masks_and_positions() -> None:
    b = pad_batch([[5, 6, 7], [8]], pad_id=0)
    assert b.input_ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert b.position_ids.tolist() == [[0, 1, 2], [0, 0, 0]]
    assert b.lengths.tolist() == [3, 1]
    assert (b.padded_tokens, b.real_tokens) == (6, 4)
    assert b.input_ids.dtype == np.int64


@pytest.mark.parametrize("bad", [[], [[1], []]])
def test_pad_batch_refuses_empty(bad: list[list[int]]) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        pad_batch(bad)


def test_last_positions_picks_each_rows_last_real_token() -> None:
    logits = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    out = last_positions(logits, np.array([3, 1]))
    assert out.tolist() == [logits[0, 2].tolist(), logits[1, 0].tolist()]


def test_top_k_logprobs_are_normalised_sorted_and_tie_stable() -> None:
    logits = np.array([[1.0, 3.0, 3.0, 0.0]], dtype=np.float32)
    ids, lps = top_k_logprobs(logits, 3)
    assert ids.tolist() == [[1, 2, 0]]  # tie between 1 and 2 broken towards the lower id
    expected = logits[0] - np.log(np.exp(logits[0]).sum())
    assert np.allclose(lps[0], expected[[1, 2, 0]], atol=1e-6)
    assert top_k_logprobs(logits, 99)[0].shape == (1, 4)  # k capped at the vocabulary


def test_pooling_ignores_padding_and_normalises() -> None:
    hidden = np.array([[[1.0, 0.0], [3.0, 0.0], [100.0, 100.0]]], dtype=np.float32)
    mask = np.array([[1, 1, 0]])
    assert pool(hidden, mask, Pooling()).tolist() == [[2.0, 0.0]]
    assert pool(hidden, mask, Pooling(normalize=True)).tolist() == [[1.0, 0.0]]
    assert pool(hidden, mask, Pooling(modes=("max", "lasttoken", "cls"))).tolist() == [[3.0, 0.0, 3.0, 0.0, 1.0, 0.0]]
