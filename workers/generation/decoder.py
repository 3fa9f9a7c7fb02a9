"""Prefill and decode steps of a causal LM with KV cache, on the worker's one ORT session.

Inputs and outputs are bound by name (optimum's GPT-2 and Llama exports order them differently):
``input_ids``, ``attention_mask``, ``position_ids``, ``past_key_values.{i}.key/.value`` in;
``logits``, ``present.{i}.key/.value`` out.

Between decode steps of an unchanged batch the cache never leaves ONNX Runtime: each step's
``present.*`` OrtValues are bound, as they are, as the next step's ``past_key_values.*`` (I/O
binding; on a GPU provider they stay in device memory). Only a membership change (rows leave or
join) brings the cache into numpy to re-lay it out (:mod:`workers.generation.kvcache`); the time
that takes is reported as the step's copy time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import onnxruntime as ort

from protocol.errors import ModelLoadError
from workers.engine import Engine
from workers.generation.kvcache import Cache, relayout
from workers.padding import pad_batch

__all__ = ["Decoder", "KVState", "PrefillOutput"]

FloatArray = npt.NDArray[np.float32]
PAST = "past_key_values."
PRESENT = "present."


@dataclass
class PrefillOutput:
    """What a batched prefill gives each of its rows."""

    last_logits: FloatArray
    """[rows, vocab] logits at each row's last real position."""
    caches: list[dict[str, FloatArray]]
    """Per row: past name → [kv_heads, length, head_dim] (the row's real columns)."""
    lengths: list[int]
    padded_tokens: int
    engine_ms: float


class KVState:
    """The running batch's cache: OrtValues while membership is unchanged, numpy when re-laid out."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        """past name → np.ndarray or ort.OrtValue ``[rows, kv_heads, width, head_dim]``."""
        self.mask: npt.NDArray[np.int64] = np.zeros((0, 0), dtype=np.int64)
        self.positions: npt.NDArray[np.int64] = np.zeros(0, dtype=np.int64)
        """Per row: real tokens in the cache = the position id of the row's next token."""

    @property
    def rows(self) -> int:
        """Sequences in the batch."""
        return int(self.mask.shape[0])

    @property
    def kv_tokens(self) -> int:
        """Real tokens held in the cache (all rows)."""
        return int(self.positions.sum())

    def as_numpy(self) -> Cache:
        """The cache as numpy arrays (views of ORT's memory for CPU OrtValues, copies for device ones)."""
        return {
            name: value if isinstance(value, np.ndarray) else np.asarray(value.numpy())
            for name, value in self.values.items()
        }

    def relayout(self, keep: list[int], joiners: PrefillOutput | None, joined: list[int]) -> float:
        """Keep rows ``keep`` (in order), then append ``joiners``' rows ``joined``; returns copy ms.

        One pass (:func:`~workers.generation.kvcache.relayout`): the kept rows are read straight out
        of ORT's memory (``OrtValue.numpy()`` is a view on CPU) and every real entry is copied once.
        """
        started = time.perf_counter()
        cache = self.as_numpy() if self.rows and keep else None
        entries = [joiners.caches[j] for j in joined] if joiners is not None else []
        lengths = [joiners.lengths[j] for j in joined] if joiners is not None else []
        kept = self.positions[keep] if self.rows else np.zeros(0, dtype=np.int64)
        self.values, self.mask = (
            relayout(cache, self.positions.tolist(), keep, entries, lengths)
            if keep or entries
            else ({}, np.zeros((0, 0), dtype=np.int64))
        )
        self.positions = np.concatenate([kept, np.asarray(lengths, dtype=np.int64)])
        return (time.perf_counter() - started) * 1000


class Decoder:
    """Runs prefill and decode steps; one per worker, used only from the scheduler thread."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.session = engine.session
        inputs = {i.name for i in self.session.get_inputs()}
        outputs = [o.name for o in self.session.get_outputs()]
        self.past_names = sorted(n for n in inputs if n.startswith(PAST))
        if not self.past_names:
            raise ModelLoadError(
                f"{engine.model_path} has no past_key_values inputs: generation needs a model exported "
                "with its KV cache (optimum's text-generation-with-past)",
                "inputs",
                "past_key_values.*",
            )
        self.present_for = {name: PRESENT + name[len(PAST):] for name in self.past_names}
        missing = [p for p in self.present_for.values() if p not in outputs]
        if missing:
            raise ModelLoadError(f"{engine.model_path} lacks outputs {missing}", "outputs", missing)
        self._has_mask = "attention_mask" in inputs
        self._has_positions = "position_ids" in inputs
        self._device = "cuda" if any(p in engine.providers for p in ("CUDAExecutionProvider",)) else "cpu"
        card = engine.card
        self._empty_shape = (card.kv_heads, 0, card.head_dim)

    def _bind_common(self, binding: ort.IOBinding, ids: Any, mask: Any, positions: Any) -> None:
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(ids))
        if self._has_mask:
            binding.bind_cpu_input("attention_mask", np.ascontiguousarray(mask))
        if self._has_positions:
            binding.bind_cpu_input("position_ids", np.ascontiguousarray(positions))
        binding.bind_output("logits", self._device)
        for name in self.past_names:
            binding.bind_output(self.present_for[name], self._device)

    def prefill(self, prompts: list[list[int]]) -> PrefillOutput:
        """One batched, right-padded forward pass over whole prompts with an empty cache."""
        padded = pad_batch(prompts, self.engine.card.pad_token_id)
        rows = len(prompts)
        binding = self.session.io_binding()
        self._bind_common(binding, padded.input_ids, padded.attention_mask, padded.position_ids)
        empty = np.zeros((rows, *self._empty_shape), dtype=np.float32)
        for name in self.past_names:
            binding.bind_cpu_input(name, empty)
        started = time.perf_counter()
        self.session.run_with_iobinding(binding)
        engine_ms = (time.perf_counter() - started) * 1000
        logits_value, *presents = binding.get_outputs()
        logits = np.asarray(logits_value.numpy())
        lengths = [len(p) for p in prompts]
        at = np.minimum(np.asarray(lengths), logits.shape[1]) - 1  # an LM-head-last model gives [rows, 1, vocab]
        last = np.asarray(logits[np.arange(rows), at, :], dtype=np.float32)
        arrays = [np.asarray(v.numpy()) for v in presents]
        caches = [
            {name: arr[r, :, : lengths[r], :] for name, arr in zip(self.past_names, arrays, strict=True)}
            for r in range(rows)
        ]
        return PrefillOutput(last, caches, lengths, padded.padded_tokens, engine_ms)

    def decode(self, state: KVState, tokens: list[int]) -> tuple[FloatArray, float]:
        """One step for every row of ``state``: feeds each row's newest token, keeps the new cache in
        ORT and returns ([rows, vocab] logits, engine ms)."""
        rows = state.rows
        ids = np.asarray(tokens, dtype=np.int64).reshape(rows, 1)
        mask = np.concatenate([state.mask, np.ones((rows, 1), dtype=np.int64)], axis=1)
        positions = state.positions.reshape(rows, 1)
        binding = self.session.io_binding()
        self._bind_common(binding, ids, mask, positions)
        for name in self.past_names:
            value = state.values[name]
            if isinstance(value, np.ndarray):
                binding.bind_cpu_input(name, np.ascontiguousarray(value))
            else:
                binding.bind_ortvalue_input(name, value)
        started = time.perf_counter()
        self.session.run_with_iobinding(binding)
        engine_ms = (time.perf_counter() - started) * 1000
        logits_value, *presents = binding.get_outputs()
        logits = np.asarray(logits_value.numpy())[:, -1, :]
        state.values = dict(zip(self.past_names, presents, strict=True))
        state.mask = mask
        state.positions = state.positions + 1
        return np.asarray(logits, dtype=np.float32), engine_ms
