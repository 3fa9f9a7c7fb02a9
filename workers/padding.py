"""Right-padding of a batch of token sequences into the model's named input arrays (pure numpy).

Right padding with ``attention_mask = 0`` and ``position_ids`` counting real tokens only never
changes a real position's result: causal attention looks only backwards, and the mask hides the
pads from bidirectional encoders. Each sequence's last real position is ``length - 1``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["PaddedBatch", "pad_batch"]

Int64Array = npt.NDArray[np.int64]


@dataclass(frozen=True)
class PaddedBatch:
    """Model inputs for one batch, plus the bookkeeping to slice results back out."""

    input_ids: Int64Array
    """[batch, padded_len] token ids, pads = pad_id."""
    attention_mask: Int64Array
    """[batch, padded_len] 1 on real tokens, 0 on pads."""
    position_ids: Int64Array
    """[batch, padded_len] 0..len-1 on real tokens, 0 on pads."""
    lengths: Int64Array
    """[batch] real lengths (tokens)."""

    @property
    def padded_tokens(self) -> int:
        """batch x padded length: the tokens the engine computes."""
        return int(self.input_ids.size)

    @property
    def real_tokens(self) -> int:
        """Tokens that belong to requests."""
        return int(self.lengths.sum())


def pad_batch(sequences: Sequence[Sequence[int]], pad_id: int = 0) -> PaddedBatch:
    """Right-pad ``sequences`` to the longest one.

    Raises:
        ValueError: ``sequences`` is empty or holds an empty sequence.
    """
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("pad_batch needs at least one non-empty sequence")
    lengths = np.fromiter((len(s) for s in sequences), dtype=np.int64, count=len(sequences))
    width = int(lengths.max())
    ids = np.full((len(sequences), width), pad_id, dtype=np.int64)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = seq
    positions = np.arange(width, dtype=np.int64)[None, :]
    mask = (positions < lengths[:, None]).astype(np.int64)
    return PaddedBatch(ids, mask, positions * mask, lengths)
