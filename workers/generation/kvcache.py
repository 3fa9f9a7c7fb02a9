"""The running batch's KV cache layout (pure numpy): left-padded rows that grow one column a step.

Every running sequence is one row of each ``past_key_values.{i}.key/.value`` tensor
``[rows, kv_heads, width, head_dim]``. A row's real entries are right-aligned (padding on the left,
``attention_mask`` 0 there), so a decode step appends one column for every row and no row ever has
a hole. ``position_ids`` come from each row's own count of real tokens, so a row's result does not
depend on its neighbours' lengths.

Layout changes happen only when membership changes: rows that leave are dropped (and columns that
every remaining row pads are trimmed); joiners' prefill caches are right-aligned into a wider
batch. Both copy the cache, so the scheduler does them at most once per step and reports the time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["Cache", "drop_rows", "join_rows", "trim_leading_pads"]

Cache = dict[str, npt.NDArray[np.float32]]
"""``past_key_values.*`` name → ``[rows, kv_heads, width, head_dim]``."""
Mask = npt.NDArray[np.int64]


def trim_leading_pads(cache: Cache, mask: Mask) -> tuple[Cache, Mask]:
    """Drop the leading columns that every row pads (``mask`` 0 in every row)."""
    if mask.shape[0] == 0:
        return cache, mask
    real_cols = np.flatnonzero(mask.any(axis=0))
    first = int(real_cols[0]) if real_cols.size else mask.shape[1]
    if first == 0:
        return cache, mask
    return {name: np.ascontiguousarray(arr[:, :, first:, :]) for name, arr in cache.items()}, mask[:, first:]


def drop_rows(cache: Cache, mask: Mask, keep: Sequence[int]) -> tuple[Cache, Mask]:
    """Keep only rows ``keep`` (in that order), then trim columns no remaining row needs."""
    index = np.asarray(keep, dtype=np.int64)
    kept = {name: arr[index] for name, arr in cache.items()}
    return trim_leading_pads(kept, mask[index])


def join_rows(
    cache: Cache | None,
    mask: Mask | None,
    joiners: Sequence[Mapping[str, npt.NDArray[np.float32]]],
    lengths: Sequence[int],
) -> tuple[Cache, Mask]:
    """Append joiners' caches as new rows after the existing ones.

    ``joiners[j][name]`` is ``[kv_heads, lengths[j], head_dim]`` (the real columns of the joiner's
    prefill). The result is as wide as the widest of the old width and the joiners' lengths; every
    row is right-aligned in it.
    """
    old_rows = 0 if mask is None else mask.shape[0]
    old_width = 0 if mask is None else mask.shape[1]
    width = max([old_width, *lengths])
    rows = old_rows + len(joiners)
    names = list(joiners[0]) if joiners else list(cache or {})
    out: Cache = {}
    for name in names:
        sample = joiners[0][name] if joiners else (cache or {})[name][0]
        heads, _, dim = sample.shape
        arr = np.zeros((rows, heads, width, dim), dtype=np.float32)
        if cache is not None and old_rows:
            arr[:old_rows, :, width - old_width :, :] = cache[name]
        for j, (entry, length) in enumerate(zip(joiners, lengths, strict=True)):
            arr[old_rows + j, :, width - length :, :] = entry[name]
        out[name] = arr
    new_mask = np.zeros((rows, width), dtype=np.int64)
    if mask is not None and old_rows:
        new_mask[:old_rows, width - old_width :] = mask
    for j, length in enumerate(lengths):
        new_mask[old_rows + j, width - length :] = 1
    return out, new_mask
