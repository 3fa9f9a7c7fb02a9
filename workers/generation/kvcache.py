"""The running batch's KV cache layout (pure numpy): right-aligned rows that grow one column a step.

Every running sequence is one row of each ``past_key_values.{i}.key/.value`` tensor
``[rows, kv_heads, width, head_dim]``. A row's real entries are right-aligned (padding on the left,
``attention_mask`` 0 there), so a decode step appends one column for every row and no row ever has
a hole: row ``r``'s real entries are always its last ``positions[r]`` columns, and ``position_ids``
come from that count, so a row's result does not depend on its neighbours' lengths.

The layout changes only when membership changes: :func:`relayout` keeps some rows and appends
joiners' prefill caches in one pass, copying each real entry once into a batch as wide as its
longest row (only the padding is zeroed). The scheduler does that at most once per step and reports
the time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["Cache", "relayout", "right_aligned_mask"]

Cache = dict[str, npt.NDArray[np.float32]]
"""``past_key_values.*`` name → ``[rows, kv_heads, width, head_dim]``."""
Mask = npt.NDArray[np.int64]


def right_aligned_mask(lengths: Sequence[int], width: int) -> Mask:
    """``attention_mask`` [rows, width]: 1 on each row's last ``lengths[row]`` columns, 0 before."""
    starts = width - np.asarray(lengths, dtype=np.int64)
    return (np.arange(width, dtype=np.int64)[None, :] >= starts[:, None]).astype(np.int64)


def relayout(
    cache: Mapping[str, npt.NDArray[np.float32]] | None,
    positions: Sequence[int],
    keep: Sequence[int],
    joiners: Sequence[Mapping[str, npt.NDArray[np.float32]]],
    lengths: Sequence[int],
) -> tuple[Cache, Mask]:
    """Rows ``keep`` of ``cache`` (in that order), then the joiners, right-aligned in one new batch.

    ``positions[r]`` is the count of real entries of row ``r`` of ``cache`` (its last columns);
    ``joiners[j][name]`` is ``[kv_heads, lengths[j], head_dim]`` (the real columns of a prefill).
    Returns the new cache (the element type of the arrays given: float32 or float16) and its
    ``attention_mask``.
    """
    kept = [int(positions[r]) for r in keep]
    sizes = kept + [int(n) for n in lengths]
    width = max(sizes, default=0)
    names = list(joiners[0]) if joiners else list(cache or {})
    out: Cache = {}
    for name in names:
        sample = joiners[0][name] if joiners else (cache or {})[name][0]
        heads, _, dim = sample.shape
        arr = np.empty((len(sizes), heads, width, dim), dtype=sample.dtype)
        for row, size in enumerate(sizes):
            if size < width:
                arr[row, :, : width - size, :] = 0.0
        if kept:
            src = (cache or {})[name]
            src_width = src.shape[2]
            for row, (r, size) in enumerate(zip(keep, kept, strict=True)):
                arr[row, :, width - size :, :] = src[r, :, src_width - size :, :]
        for j, (entry, size) in enumerate(zip(joiners, lengths, strict=True)):
            arr[len(kept) + j, :, width - size :, :] = entry[name]
        out[name] = arr
    return out, right_aligned_mask(sizes, width)
