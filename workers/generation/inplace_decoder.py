"""Prefill and decode steps on the in-place KV cache (:mod:`workers.generation.slots`).

The graph's attention is ``GroupQueryAttention`` (:mod:`tools.inplace_kv`): each ``past_key_values.*``
input and its ``present.*`` output are bound to the same run of slots of the cache's buffer, so the
model writes new keys and values at each row's own column and nothing else is copied. Inputs follow
the slot protocol of :mod:`tools.inplace_kv`: ``attention_mask`` rows hold ``past + new`` ones
(right-aligned in a decode step, so an LM-head-last graph finds each row's token at column 0),
``position_ids`` count each token's column.

Three kinds of call:

- :meth:`InPlaceDecoder.prefill_first`: prompts that start empty, right-padded, in one run of slots;
- :meth:`InPlaceDecoder.prefill_after`: a prompt's next tokens after what its slot holds (a cached
  prefix, an earlier chunk), one slot per call;
- :meth:`InPlaceDecoder.decode_slots`: one token for every slot ``0 .. span-1``.

Where the slots live: host memory on the CPU provider; device memory on a GPU session
(:attr:`InPlaceDecoder.slots_on_device`; the graph must be float16 and the CUDA provider active, since it
runs ``GroupQueryAttention``). The transfer meter of :class:`~workers.generation.decoder.Decoder` counts
what is bound from the host and the logits read back; the cache itself is never bound from a fresh array.

Fixed steps (:attr:`InPlaceDecoder.fixed_steps`, on when the session captures CUDA graphs:
:mod:`workers.cuda_graph`): a decode step over a span of slots writes its ids, positions and a mask as
wide as the slots' capacity into buffers made once for that span and cache, and reads its logits from
another, so every step of a span runs the same shapes at the same addresses: the graph captured at its
first steps is replayed at the next. The mask costs ``span x capacity x 8`` bytes host→device a step.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import onnxruntime as ort

from protocol.errors import ModelLoadError
from workers.cuda_graph import run_options
from workers.engine import Engine
from workers.generation.decoder import Decoder
from workers.generation.slots import SlotCache
from workers.padding import pad_batch

__all__ = ["FixedStep", "InPlaceDecoder"]

FloatArray = npt.NDArray[np.float32]
_ELEMENT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


@dataclass(frozen=True)
class FixedStep:
    """The buffers of the decode steps over one span of one cache: bound once, rewritten at each step."""

    binding: ort.IOBinding
    """Holds the buffers below and the span's slots, as inputs and outputs."""
    ids: ort.OrtValue
    """``[span, 1]`` int64."""
    mask: ort.OrtValue
    """``[span, capacity]`` int64, each row's ones right-aligned."""
    positions: ort.OrtValue
    """``[span, 1]`` int64."""
    logits: ort.OrtValue
    """``[span, 1, vocab]`` of the graph's logits type."""
    options: ort.RunOptions | None
    """The run options naming this span's CUDA graph (None: a session without graphs)."""


def _check_capacity(cache: SlotCache, mask: npt.NDArray[np.int64]) -> None:
    """Raises ValueError when a row of ``mask`` holds more tokens than a slot of ``cache``."""
    longest = int(mask.sum(axis=1).max())
    if longest > cache.capacity:
        raise ValueError(f"a row would hold {longest} tokens; the KV slots hold {cache.capacity} (the card's "
                         "max_positions)")


class InPlaceDecoder(Decoder):
    """A :class:`Decoder` for graphs whose attention writes the cache in place; one per worker."""

    writes_in_place = True
    probe_error: float | None = None
    """The load-time probe's relative error (:func:`~workers.generation.inplace_check.open_decoder`)."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self._step_binding: tuple[SlotCache, int, ort.IOBinding] | None = None
        """The decode steps' binding: its cache bindings hold while the span of slots stays the same."""
        if not (self._has_mask and self._has_positions):
            raise ModelLoadError(f"{engine.model_path}: an in-place cache needs attention_mask and position_ids inputs",
                                 "inputs", ["attention_mask", "position_ids"])
        if self.device[0] != "cpu" and "CUDAExecutionProvider" not in self.session.get_providers():
            raise ModelLoadError("the in-place KV cache on a GPU needs the CUDA provider active (it runs "
                                 f"GroupQueryAttention); the session runs on {self.session.get_providers()}",
                                 "engine.kv_cache", "in_place")
        self.slots_on_device = self.device[0] != "cpu"
        """Slot buffers as ONNX Runtime values on :attr:`device` (a GPU session) rather than numpy; a test may set
        it on a CPU session to run the device path there."""
        self.fixed_steps = engine.cuda_graph
        """Decode steps on fixed shapes at fixed addresses (see the module doc): on when the session captures
        CUDA graphs; a test may set it on a CPU session to run that path there."""
        self._fixed: weakref.WeakKeyDictionary[SlotCache, dict[int, FixedStep]] = weakref.WeakKeyDictionary()
        logits_type = next(o.type for o in self.session.get_outputs() if o.name == "logits")
        self._logits_dtype = _ELEMENT_TYPES.get(logits_type, np.float32)

    @property
    def supports_prefix_reuse(self) -> bool:
        return True

    @property
    def replays_graphs(self) -> bool:
        """True when the session captures CUDA graphs and the decode steps are fixed steps (see the module doc)."""
        return self.engine.cuda_graph and self.fixed_steps

    def new_cache(self, slots: int) -> SlotCache:
        """A cache of ``slots`` slots, each as long as the model card's ``max_positions``.

        Raises:
            ModelLoadError: the cache cannot be allocated (field ``max_positions``, limit the card's value;
                the message names the bytes it needs): a card claiming more positions than memory holds.
        """
        card = self.engine.card
        try:
            return self.slot_cache(slots, card.max_positions)
        except Exception as exc:  # host: MemoryError; a device: ORT's RuntimeException ("Failed to allocate …")
            if not isinstance(exc, MemoryError) and "alloc" not in str(exc).lower():
                raise
            needed = len(self.past_names) * slots * card.kv_heads * card.max_positions * card.head_dim \
                * np.dtype(self.kv_dtype).itemsize
            where = f"{self.device[0]}:{self.device[1]}" if self.slots_on_device else "host memory"
            raise ModelLoadError(
                f"{card.name} {card.version}: the in-place KV cache of {slots} slots x {card.max_positions} tokens "
                f"(the card's max_positions) needs {needed} bytes ({needed / 2**30:.1f} GiB) in {where}, which "
                f"cannot be allocated ({type(exc).__name__}: {exc}); is the card's max_positions the graph's?",
                "max_positions", card.max_positions) from exc

    def slot_cache(self, slots: int, capacity: int) -> SlotCache:
        """``slots`` slots of ``capacity`` tokens, of the graph's type, where :attr:`slots_on_device` says."""
        card = self.engine.card
        return SlotCache(self.past_names, slots=slots, kv_heads=card.kv_heads, capacity=capacity,
                         head_dim=card.head_dim, dtype=self.kv_dtype,
                         device=self.device if self.slots_on_device else None)

    def _bind_slots(self, binding: ort.IOBinding, cache: SlotCache, first: int, rows: int) -> None:
        heads, capacity, dim = cache.slot_shape
        shape = [rows, heads, capacity, dim]
        kind, index = cache.device
        for name in self.past_names:
            pointer = cache.pointer(name, first)
            binding.bind_input(name, kind, index, cache.dtype, shape, pointer)
            binding.bind_output(self.present_for[name], kind, index, cache.dtype, shape, pointer)

    def _step_binding_for(self, cache: SlotCache, rows: int) -> ort.IOBinding:
        """The binding of a decode step over slots ``0 .. rows - 1``: the last step's while the cache and
        the span are the same (its 2 × layers cache bindings then still hold: the buffers never move), so
        a step rebinds only its ids, mask, positions and logits."""
        held = self._step_binding
        if held is not None and held[0] is cache and held[1] == rows:
            return held[2]
        binding = self.session.io_binding()
        binding.bind_output("logits", "cpu", 0)  # first: outputs come back in the order they were first bound
        self._bind_slots(binding, cache, 0, rows)
        self._step_binding = (cache, rows, binding)
        return binding

    def _run(self, cache: SlotCache, first: int, ids: npt.NDArray[np.int64], mask: npt.NDArray[np.int64],
             positions: npt.NDArray[np.int64], *, step: bool = False) -> tuple[FloatArray, float]:
        """One call over slots ``first .. first + rows - 1``; returns (logits [rows, S or 1, vocab], ms).
        ``step``: a decode step (``first`` 0), on the binding kept for the steps of one span."""
        rows = int(ids.shape[0])
        _check_capacity(cache, mask)
        binding = self._step_binding_for(cache, rows) if step else self.session.io_binding()
        self._bind_input(binding, "input_ids", ids)
        self._bind_input(binding, "attention_mask", mask)
        self._bind_input(binding, "position_ids", positions)
        binding.bind_output("logits", "cpu", 0)
        if not step:
            self._bind_slots(binding, cache, first, rows)
        started = time.perf_counter()
        self.session.run_with_iobinding(binding, self.engine.run_options)
        engine_ms = (time.perf_counter() - started) * 1000
        logits_value = binding.get_outputs()[0]
        return self._fetch(logits_value), engine_ms

    def prefill_first(self, cache: SlotCache, slots: Sequence[int], prompts: Sequence[Sequence[int]]
                      ) -> tuple[FloatArray, float, int]:
        """Prompts that start empty into consecutive ``slots`` (ascending); returns ([rows, vocab] logits at
        each prompt's last token, engine ms, padded tokens computed)."""
        first = slots[0]
        if list(slots) != list(range(first, first + len(slots))):
            raise ValueError(f"slots {list(slots)} are not consecutive")
        padded = pad_batch([list(p) for p in prompts], self.engine.card.pad_token_id)
        logits, engine_ms = self._run(cache, first, padded.input_ids, padded.attention_mask.astype(np.int64),
                                      padded.position_ids)
        lengths = np.asarray([len(p) for p in prompts], dtype=np.int64)
        cache.lengths[first : first + len(slots)] = lengths
        at = np.minimum(lengths, logits.shape[1]) - 1  # an LM-head-last graph gives [rows, 1, vocab]
        self._prefills += 1
        self._tokens += len(slots)
        return np.asarray(logits[np.arange(len(slots)), at, :], dtype=np.float32), engine_ms, padded.padded_tokens

    def prefill_after(self, cache: SlotCache, slot: int, tokens: Sequence[int]) -> tuple[FloatArray, float]:
        """``tokens`` after the ``cache.lengths[slot]`` the slot holds; returns ([vocab] logits at the last, ms)."""
        past = int(cache.lengths[slot])
        count = len(tokens)
        ids = np.asarray(tokens, dtype=np.int64).reshape(1, count)
        mask = np.ones((1, past + count), dtype=np.int64)
        positions = np.arange(past, past + count, dtype=np.int64).reshape(1, count)
        logits, engine_ms = self._run(cache, slot, ids, mask, positions)
        cache.lengths[slot] = past + count
        self._prefills += 1
        self._tokens += 1
        return np.asarray(logits[0, -1, :], dtype=np.float32), engine_ms

    def decode_slots(self, cache: SlotCache, tokens: Mapping[int, int]) -> tuple[FloatArray, float]:
        """One token for each taken slot (``tokens``: slot → its newest token); returns ([span, vocab] logits,
        by slot, engine ms). A free slot inside the span runs as a dummy row of one token."""
        span = cache.span
        lengths = np.where([cache.taken(s) for s in range(span)], cache.lengths[:span], 0)
        totals = lengths + 1
        width = cache.capacity if self.fixed_steps else int(totals.max())
        mask = (np.arange(width)[None, :] >= (width - totals)[:, None]).astype(np.int64)
        ids = np.full((span, 1), self.engine.card.pad_token_id, dtype=np.int64)
        for slot, token in tokens.items():
            ids[slot, 0] = token
        positions = lengths.reshape(span, 1).astype(np.int64)
        if self.fixed_steps:
            logits, engine_ms = self._fixed_step(cache, ids, mask, positions)
        else:
            logits, engine_ms = self._run(cache, 0, ids, mask, positions, step=True)
        for slot in tokens:
            cache.lengths[slot] += 1
        self._decode_steps += 1
        self._tokens += len(tokens)
        return np.asarray(logits[:, -1, :], dtype=np.float32), engine_ms

    def _fixed_step(self, cache: SlotCache, ids: npt.NDArray[np.int64], mask: npt.NDArray[np.int64],
                    positions: npt.NDArray[np.int64]) -> tuple[FloatArray, float]:
        """A decode step over slots ``0 .. span - 1`` through the span's :class:`FixedStep`; returns (a copy of
        the logits [span, 1, vocab] as float32, engine ms)."""
        _check_capacity(cache, mask)
        step = self._fixed_for(cache, int(ids.shape[0]))
        for value, array in ((step.ids, ids), (step.mask, mask), (step.positions, positions)):
            value.update_inplace(np.ascontiguousarray(array))
            self._h2d_bytes += array.nbytes
        started = time.perf_counter()
        self.session.run_with_iobinding(step.binding, step.options)
        engine_ms = (time.perf_counter() - started) * 1000
        # a copy: the next step of the span writes the same buffer (on the CPU provider numpy() is a view)
        return np.array(self._fetch(step.logits), dtype=np.float32), engine_ms

    def _fixed_for(self, cache: SlotCache, span: int) -> FixedStep:
        """The buffers of the steps over ``span`` slots of ``cache``, made and bound at its first step (with a
        new CUDA graph id when the session captures graphs)."""
        steps = self._fixed.setdefault(cache, {})
        held = steps.get(span)
        if held is not None:
            return held
        kind, index = self.device

        def buffer(shape: list[int], dtype: Any) -> ort.OrtValue:
            value = ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, kind, index)
            value.update_inplace(np.zeros(shape, dtype=dtype))
            return value

        binding = self.session.io_binding()
        logits = buffer([span, 1, self.engine.card.vocab_size], self._logits_dtype)
        binding.bind_ortvalue_output("logits", logits)  # first: outputs come back in the order they were bound
        self._bind_slots(binding, cache, 0, span)
        ids, mask, positions = buffer([span, 1], np.int64), buffer([span, cache.capacity], np.int64), \
            buffer([span, 1], np.int64)
        for name, value in (("input_ids", ids), ("attention_mask", mask), ("position_ids", positions)):
            binding.bind_ortvalue_input(name, value)
        options = run_options(self.engine.next_graph_id()) if self.engine.cuda_graph else None
        steps[span] = FixedStep(binding, ids, mask, positions, logits, options)
        return steps[span]
