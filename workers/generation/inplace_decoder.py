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
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt
import onnxruntime as ort

from protocol.errors import ModelLoadError
from workers.engine import Engine
from workers.generation.decoder import Decoder
from workers.generation.slots import SlotCache
from workers.padding import pad_batch

__all__ = ["InPlaceDecoder"]

FloatArray = npt.NDArray[np.float32]


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

    @property
    def supports_prefix_reuse(self) -> bool:
        return True

    def new_cache(self, slots: int) -> SlotCache:
        """A cache of ``slots`` slots, each as long as the model card's ``max_positions``."""
        card = self.engine.card
        return self.slot_cache(slots, card.max_positions)

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
        if int(mask.sum(axis=1).max()) > cache.capacity:
            raise ValueError(f"a row would hold {int(mask.sum(axis=1).max())} tokens; the KV slots hold "
                             f"{cache.capacity} (the card's max_positions)")
        binding = self._step_binding_for(cache, rows) if step else self.session.io_binding()
        self._bind_input(binding, "input_ids", ids)
        self._bind_input(binding, "attention_mask", mask)
        self._bind_input(binding, "position_ids", positions)
        binding.bind_output("logits", "cpu", 0)
        if not step:
            self._bind_slots(binding, cache, first, rows)
        started = time.perf_counter()
        self.session.run_with_iobinding(binding)
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
        width = int(totals.max())
        mask = (np.arange(width)[None, :] >= (width - totals)[:, None]).astype(np.int64)
        ids = np.full((span, 1), self.engine.card.pad_token_id, dtype=np.int64)
        for slot, token in tokens.items():
            ids[slot, 0] = token
        logits, engine_ms = self._run(cache, 0, ids, mask, lengths.reshape(span, 1).astype(np.int64), step=True)
        for slot in tokens:
            cache.lengths[slot] += 1
        self._decode_steps += 1
        self._tokens += len(tokens)
        return np.asarray(logits[:, -1, :], dtype=np.float32), engine_ms
