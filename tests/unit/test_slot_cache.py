"""The in-place cache's slot bookkeeping (pure numpy): which slots are taken, the span a decode step binds,
consecutive runs for a batched prefill, and what is copied in and out."""

from __future__ import annotations

import numpy as np
import pytest

from workers.generation.slots import SlotCache, contiguous_runs


def test_contiguous_runs_group_consecutive_slots_in_order() -> None:
    assert contiguous_runs([]) == []
    assert contiguous_runs([4, 0, 1, 2, 7, 5]) == [[0, 1, 2], [4, 5], [7]]


def _cache(slots: int = 4) -> SlotCache:
    return SlotCache(["past_key_values.0.key", "past_key_values.0.value"], slots=slots, kv_heads=2, capacity=8,
                     head_dim=3)


def test_slots_are_taken_lowest_first_and_the_span_ends_at_the_highest_taken() -> None:
    cache = _cache()
    assert cache.span == 0 and cache.free == 4
    assert cache.take(3) == [0, 1, 2]
    cache.release(1)
    assert cache.span == 3 and cache.free == 2  # a hole inside the span stays a dummy row
    assert cache.take(1) == [1]
    cache.release(2)
    assert cache.span == 2
    with pytest.raises(RuntimeError, match="3 KV slots wanted, 2 free of 4"):
        cache.take(3)
    cache.release_all()
    assert cache.span == 0 and cache.free == 4


def test_a_slot_is_written_and_read_in_its_own_columns_and_the_bytes_are_counted() -> None:
    cache = _cache()
    (slot,) = cache.take(1)
    kv = {name: np.full((2, 5, 3), i + 1.0, dtype=np.float32) for i, name in enumerate(cache.past_names)}
    cache.write(slot, kv)
    assert cache.lengths[slot] == 5
    out = cache.read(slot, 5)
    assert all(np.array_equal(out[name], kv[name]) for name in kv)
    assert cache.written_bytes == cache.read_bytes == 2 * 2 * 5 * 3 * 4
    assert not cache.buffers["past_key_values.0.key"][slot + 1].any()  # the next slot is untouched
    buffer = cache.buffers["past_key_values.0.key"]
    assert cache.pointer("past_key_values.0.key", 2) == buffer.ctypes.data + 2 * buffer[0].nbytes
