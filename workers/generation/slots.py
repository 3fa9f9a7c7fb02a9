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

Where the buffers live: host memory (numpy) for a CPU session; with a ``device`` (a CUDA session: the
decoder's device), one ONNX Runtime value per past on that device, so a decode step reads and writes the
cache where the model runs and nothing of it crosses the bus. Copies into and out of a slot (the prefix
cache's) then go through :class:`~workers.generation.slot_copy.SlotCopier`.

Sizes: ``slots`` is the loop's ``max_batch_size``; ``capacity`` the model card's ``max_positions``
(tokens). Memory = ``2 x layers x slots x kv_heads x capacity x head_dim x`` 4 bytes (float32) or 2
(float16) (:attr:`SlotCache.nbytes`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import onnxruntime as ort

from workers.generation.slot_copy import SlotCopier

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
                 head_dim: int, dtype: type[np.floating[Any]] = np.float32,
                 device: tuple[str, int] | None = None) -> None:
        """``dtype``: the element type of the graph's past inputs (float32 or float16). ``device``: None keeps
        the buffers in host memory (numpy); ``("cuda" | "cpu", id)`` makes them ONNX Runtime values there."""
        if slots < 1 or capacity < 2:
            raise ValueError(f"slots={slots} must be >= 1 and capacity={capacity} >= 2")
        self.past_names = list(past_names)
        self.slots = slots
        self.capacity = capacity
        self.dtype = np.dtype(dtype)
        self.shape = (slots, kv_heads, capacity, head_dim)
        """Of each buffer: ``[slots, kv_heads, capacity, head_dim]``."""
        self.device = device or ("cpu", 0)
        """Where the buffers are (what a binding names)."""
        self.buffers: dict[str, FloatArray] = {}
        """Host buffers by past name (empty when the buffers are on a device)."""
        self.values: dict[str, ort.OrtValue] = {}
        """Device buffers by past name (empty for host buffers)."""
        self._copier: SlotCopier | None = None
        if device is None:
            self.buffers = {name: np.zeros(self.shape, dtype=dtype) for name in self.past_names}
        else:
            zeros = np.zeros(self.shape, dtype=dtype)
            for name in self.past_names:
                value = ort.OrtValue.ortvalue_from_shape_and_type(list(self.shape), dtype, device[0], device[1])
                value.update_inplace(zeros)  # a free slot inside a decode step's span reads its first column
                self.values[name] = value
            self._copier = SlotCopier(self.past_names, kv_heads=kv_heads, head_dim=head_dim, dtype=self.dtype,
                                      device=device)
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
        return len(self.past_names) * int(np.prod(self.shape)) * self.dtype.itemsize

    @property
    def on_device(self) -> bool:
        """True when the buffers are ONNX Runtime values (a ``device`` was given), not numpy."""
        return self._copier is not None

    @property
    def slot_shape(self) -> tuple[int, int, int]:
        """``(kv_heads, capacity, head_dim)`` of one slot."""
        _, heads, capacity, dim = self.shape
        return heads, capacity, dim

    def _slot_bytes(self) -> int:
        return int(np.prod(self.shape[1:])) * self.dtype.itemsize

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
        """Address of slot ``first_slot`` of buffer ``name`` (a run of slots starts there; on ``device``)."""
        base = int(self.values[name].data_ptr()) if self.on_device else int(self.buffers[name].ctypes.data)
        return base + first_slot * self._slot_bytes()

    def _head_address(self, slot: int) -> Callable[[str, int], int]:
        """``(name, head) →`` the address of column 0 of that head in ``slot``."""
        _, _, capacity, dim = self.shape
        head_bytes = capacity * dim * self.dtype.itemsize
        return lambda name, head: self.pointer(name, slot) + head * head_bytes

    def write(self, slot: int, kv: Mapping[str, FloatArray]) -> None:
        """Copy ``kv`` (name → ``[kv_heads, n, head_dim]``, host) into columns ``0..n-1`` of ``slot``; length = n."""
        size = next(iter(kv.values())).shape[1] if kv else 0
        if self._copier is not None:
            if size:
                self._copier.write(self._head_address(slot), kv)
        else:
            for name, array in kv.items():
                self.buffers[name][slot, :, :size, :] = array
        self.written_bytes += sum(int(np.prod(a.shape)) * self.dtype.itemsize for a in kv.values())
        self.lengths[slot] = size

    def read(self, slot: int, tokens: int) -> dict[str, FloatArray]:
        """A host copy of the first ``tokens`` columns of ``slot``: name → ``[kv_heads, tokens, head_dim]``."""
        if self._copier is not None and tokens:
            out = self._copier.read(self._head_address(slot), tokens)
        elif self._copier is not None:
            out = {name: np.zeros((self.shape[1], 0, self.shape[3]), dtype=self.dtype) for name in self.past_names}
        else:
            out = {name: np.array(buffer[slot, :, :tokens, :]) for name, buffer in self.buffers.items()}
        self.read_bytes += sum(a.nbytes for a in out.values())
        return out
