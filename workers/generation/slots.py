"""The in-place KV cache: one preallocated buffer per past tensor, one slot per running sequence.

For a graph whose attention is ``GroupQueryAttention`` (:mod:`tools.inplace_kv`), every
``past_key_values.*`` input and its ``present.*`` output are bound to the same buffer
``[slots, kv_heads, capacity, head_dim]`` (the graph's float32 or float16, host memory): a step writes
each row's new keys and values at the row's own column and reads only its first ``length + 1`` columns.
A sequence owns
one slot from its first prefill to its end; a join writes only the joiner's slot and a leave frees
one, so no other sequence's cache ever moves and a decode step copies no past.

A call binds a contiguous run of slots (a pointer into the buffer): a decode step binds slots
``0 .. span-1`` (a free slot inside the span is a dummy row of length 1 whose result is ignored);
a first-prompt prefill binds the joiners' run; a prompt that continues after a cached prefix or an
earlier chunk binds its one slot.

Sizes: ``slots`` is the loop's ``max_batch_size``; ``capacity`` the model card's ``max_positions``
(tokens). Memory = ``2 x layers x slots x kv_heads x capacity x head_dim x`` 4 bytes (float32) or 2
(float16) (:attr:`SlotCache.nbytes`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["SlotCache", "contiguous_runs"]

FloatArray = npt.NDArray[np.floating[Any]]


def contiguous_runs(slots: Sequence[int]) -> list[list[int]]:
    """``slots`` (any order) grouped into runs of consecutive numbers, each ascending (pure)."""
    runs: list[list[int]] = []
    for slot in sorted(slots):
        if runs and runs[-1][-1] + 1 == slot:
            runs[-1].append(slot)
        else:
            runs.append([slot])
    return runs


class SlotCache:
    """The buffers, which slots are taken, and how many tokens each slot holds."""

    def __init__(self, past_names: Sequence[str], *, slots: int, kv_heads: int, capacity: int,
                 head_dim: int, dtype: type[np.floating[Any]] = np.float32) -> None:
        """``dtype``: the element type of the graph's past inputs (float32 or float16)."""
        if slots < 1 or capacity < 2:
            raise ValueError(f"slots={slots} must be >= 1 and capacity={capacity} >= 2")
        self.past_names = list(past_names)
        self.slots = slots
        self.capacity = capacity
        self.buffers: dict[str, FloatArray] = {
            name: np.zeros((slots, kv_heads, capacity, head_dim), dtype=dtype) for name in self.past_names
        }
        self.dtype = np.dtype(dtype)
        self.lengths = np.zeros(slots, dtype=np.int64)
        """Per slot: tokens whose KV it holds (its next token's column)."""
        self._taken = np.zeros(slots, dtype=bool)
        self.written_bytes = 0
        """Bytes copied into slots from outside the model (prefix-cache hits)."""
        self.read_bytes = 0
        """Bytes copied out of slots (to the prefix cache)."""

    @property
    def nbytes(self) -> int:
        """Bytes of all buffers."""
        return sum(b.nbytes for b in self.buffers.values())

    @property
    def slot_shape(self) -> tuple[int, int, int]:
        """``(kv_heads, capacity, head_dim)`` of one slot."""
        _, heads, capacity, dim = next(iter(self.buffers.values())).shape
        return heads, capacity, dim

    @property
    def free(self) -> int:
        """Slots not taken."""
        return int(self.slots - self._taken.sum())

    @property
    def span(self) -> int:
        """1 + the highest taken slot (0 when none is): the rows of a decode step."""
        taken = np.flatnonzero(self._taken)
        return int(taken[-1]) + 1 if taken.size else 0

    def taken(self, slot: int) -> bool:
        return bool(self._taken[slot])

    def take(self, count: int) -> list[int]:
        """The lowest ``count`` free slots, marked taken with length 0.

        Raises:
            RuntimeError: fewer than ``count`` are free (the loop admits at most ``slots`` sequences).
        """
        free = np.flatnonzero(~self._taken)[:count]
        if free.size < count:
            raise RuntimeError(f"{count} KV slots wanted, {free.size} free of {self.slots}")
        self._taken[free] = True
        self.lengths[free] = 0
        return [int(s) for s in free]

    def release(self, slot: int) -> None:
        """Frees ``slot`` (its buffer is left as it is: the next owner overwrites what it reads)."""
        self._taken[slot] = False
        self.lengths[slot] = 0

    def release_all(self) -> None:
        self._taken[:] = False
        self.lengths[:] = 0

    def pointer(self, name: str, first_slot: int) -> int:
        """Address of slot ``first_slot`` of buffer ``name`` (a run of slots starts there)."""
        buffer = self.buffers[name]
        return int(buffer.ctypes.data) + first_slot * int(buffer[0].nbytes)

    def write(self, slot: int, kv: Mapping[str, FloatArray]) -> None:
        """Copy ``kv`` (name → ``[kv_heads, n, head_dim]``) into columns ``0..n-1`` of ``slot``; length = n."""
        size = 0
        for name, array in kv.items():
            size = array.shape[1]
            self.buffers[name][slot, :, :size, :] = array
            self.written_bytes += array.nbytes
        self.lengths[slot] = size

    def read(self, slot: int, tokens: int) -> dict[str, FloatArray]:
        """A copy of the first ``tokens`` columns of ``slot``: name → ``[kv_heads, tokens, head_dim]``."""
        out = {name: np.array(buffer[slot, :, :tokens, :]) for name, buffer in self.buffers.items()}
        self.read_bytes += sum(a.nbytes for a in out.values())
        return out
