"""Prefill and decode steps of a causal LM with KV cache, on the worker's one ORT session.

Inputs and outputs are bound by name (optimum's GPT-2 and Llama exports order them differently):
``input_ids``, ``attention_mask``, ``position_ids``, ``past_key_values.{i}.key/.value`` in;
``logits``, ``present.{i}.key/.value`` out.

Between decode steps of an unchanged batch the cache never leaves ONNX Runtime: each step's
``present.*`` OrtValues are bound, as they are, as the next step's ``past_key_values.*`` (I/O
binding; on a GPU provider they stay in device memory). Only a membership change (rows leave or
join) brings the cache into numpy to re-lay it out (:mod:`workers.generation.kvcache`); the time
that takes is reported as the step's copy time.

Device: outputs are bound on the device of the session's first *active* GPU provider
(TensorRT or CUDA, :func:`decoder_device`), with the ``device_id`` the session applied to it;
CPU otherwise.

Transfer meter (:attr:`Decoder.transfers`, a :class:`Transfers` snapshot): bytes of the arrays
that cross between host and device, counted from what is bound and fetched -- every
``bind_cpu_input`` array is host→device, every ``OrtValue.numpy()`` of an output (logits, the
prefill's presents, the cache a re-layout reads) is device→host. On a CPU device nothing is
copied (``numpy()`` is a view) and the same counts are what *would* cross on a GPU
(``Transfers.crossed`` is False).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import onnxruntime as ort

from protocol.errors import ModelLoadError
from workers.engine import Engine
from workers.generation.kvcache import Cache, relayout, right_aligned_mask
from workers.generation.prefix_cache import PrefixHit
from workers.padding import pad_batch

__all__ = ["Decoder", "KVState", "PrefillOutput", "Transfers", "decoder_device"]

FloatArray = npt.NDArray[np.float32]
PAST = "past_key_values."
PRESENT = "present."
GPU_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider")
"""Providers whose outputs live in CUDA device memory."""


def decoder_device(
    active_providers: Sequence[str], applied_options: Mapping[str, Mapping[str, str]]
) -> tuple[str, int]:
    """The (device type, device id) to bind outputs on, from a session's active providers.

    ``active_providers`` is ``InferenceSession.get_providers()`` (priority order) and
    ``applied_options`` its ``get_provider_options()`` (values as strings). The first active
    TensorRT or CUDA provider gives ``("cuda", int(its "device_id"))`` (0 when absent); with
    neither active, ``("cpu", 0)``.
    """
    for provider in active_providers:
        if provider in GPU_PROVIDERS:
            return "cuda", int(applied_options.get(provider, {}).get("device_id", "0"))
    return "cpu", 0


@dataclass(frozen=True)
class Transfers:
    """Cumulative host↔device traffic of one decoder (prefills, decode steps and cache re-layouts).

    Byte counts are the ``nbytes`` of the arrays bound with ``bind_cpu_input`` (host→device: ids,
    mask, positions, and the cache while it is numpy: the empty prefill cache, the first decode
    after a membership change) and of the outputs read with ``OrtValue.numpy()`` (device→host:
    logits, the prefill's presents, the running cache a re-layout reads). The cache of an unchanged
    batch stays bound as OrtValues and is not counted. When ``crossed`` is False (a CPU device)
    nothing was copied: the counts are what would cross if the device were a GPU.
    """

    device: str
    """``"cuda:<id>"`` or ``"cpu"``."""
    h2d_bytes: int
    """Bytes host → device."""
    d2h_bytes: int
    """Bytes device → host (a re-layout's read is counted at the next decode step)."""
    prefills: int
    """Prefill calls."""
    decode_steps: int
    """Decode calls."""
    tokens: int
    """Tokens generated: one per prefilled row (its first token) and one per row of each decode step."""

    @property
    def crossed(self) -> bool:
        """True when the bytes really crossed (a GPU device); False: what would cross on one."""
        return self.device != "cpu"

    @property
    def bytes_per_token(self) -> float:
        """Bytes copied host↔device (both ways) per generated token; 0.0 before any token."""
        return (self.h2d_bytes + self.d2h_bytes) / self.tokens if self.tokens else 0.0

    def since(self, earlier: Transfers) -> Transfers:
        """The traffic between ``earlier`` (a snapshot of the same decoder) and this one."""
        return Transfers(
            self.device,
            self.h2d_bytes - earlier.h2d_bytes,
            self.d2h_bytes - earlier.d2h_bytes,
            self.prefills - earlier.prefills,
            self.decode_steps - earlier.decode_steps,
            self.tokens - earlier.tokens,
        )


@dataclass
class PrefillOutput:
    """What a batched prefill gives each of its rows."""

    last_logits: FloatArray
    """[rows, vocab] logits at each row's last real position."""
    caches: list[dict[str, FloatArray]]
    """Per row: past name → [kv_heads, length, head_dim] (the row's real columns)."""
    lengths: list[int]
    padded_tokens: int
    """Rows x padded width of the tokens computed (a reused prefix is not computed)."""
    engine_ms: float
    reused: list[int]
    """Per row: prompt tokens taken from the prefix cache (0 without a hit)."""


class KVState:
    """The running batch's cache: OrtValues while membership is unchanged, numpy when re-laid out."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        """past name → np.ndarray or ort.OrtValue ``[rows, kv_heads, width, head_dim]``."""
        self.mask: npt.NDArray[np.int64] = np.zeros((0, 0), dtype=np.int64)
        self.positions: npt.NDArray[np.int64] = np.zeros(0, dtype=np.int64)
        """Per row: real tokens in the cache = the position id of the row's next token."""
        self.fetched_bytes = 0
        """Bytes of ORT cache values read into numpy by re-layouts and not yet counted by a decoder
        (device→host on a GPU); :meth:`Decoder.decode` adds them to its meter and resets this."""
        self.fetched: Cache | None = None
        """:meth:`fetch`'s numpy copy of ``values``, while they are unchanged."""

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

    def fetch(self) -> Cache:
        """The cache as numpy (:meth:`as_numpy`), its device→host bytes counted in ``fetched_bytes``; made
        once per cache (kept until a decode step or a re-layout replaces the values)."""
        if self.fetched is None:
            self.fetched = self.as_numpy()
            self.fetched_bytes += sum(
                array.nbytes for name, array in self.fetched.items() if not isinstance(self.values[name], np.ndarray)
            )
        return self.fetched

    def row_cache(self, cache: Cache, row: int) -> Cache:
        """Row ``row``'s real columns of ``cache`` (a :meth:`fetch`): name → ``[kv_heads, positions[row], head_dim]``
        (views)."""
        size = int(self.positions[row])
        return {name: array[row, :, array.shape[2] - size :, :] for name, array in cache.items()}

    def relayout(self, keep: list[int], joiners: PrefillOutput | None, joined: list[int]) -> float:
        """Keep rows ``keep`` (in order), then append ``joiners``' rows ``joined``; returns copy ms.

        One pass (:func:`~workers.generation.kvcache.relayout`): the kept rows are read straight out
        of ORT's memory (``OrtValue.numpy()`` is a view on CPU) and every real entry is copied once.
        """
        started = time.perf_counter()
        cache = self.fetch() if self.rows and keep else None
        entries = [joiners.caches[j] for j in joined] if joiners is not None else []
        lengths = [joiners.lengths[j] for j in joined] if joiners is not None else []
        kept = self.positions[keep] if self.rows else np.zeros(0, dtype=np.int64)
        self.values, self.mask = (
            relayout(cache, self.positions.tolist(), keep, entries, lengths)
            if keep or entries
            else ({}, np.zeros((0, 0), dtype=np.int64))
        )
        self.positions = np.concatenate([kept, np.asarray(lengths, dtype=np.int64)])
        self.fetched = None
        return (time.perf_counter() - started) * 1000


class Decoder:
    """Runs prefill and decode steps; one per worker, used only from the scheduler thread."""

    writes_in_place = False
    """True for graphs whose attention writes the cache in place (the subclass for them)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.session = engine.session
        if engine.kv.in_place and not self.writes_in_place:
            raise ModelLoadError(
                f"{engine.model_path} is served with the in-place KV cache (engine.kv_cache): its decoder is "
                "workers.generation.inplace_check.open_decoder's InPlaceDecoder", "engine.kv_cache", "in_place")
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
        self.present_for = {name: PRESENT + name[len(PAST) :] for name in self.past_names}
        missing = [p for p in self.present_for.values() if p not in outputs]
        if missing:
            raise ModelLoadError(f"{engine.model_path} lacks outputs {missing}", "outputs", missing)
        self._has_mask = "attention_mask" in inputs
        self._has_positions = "position_ids" in inputs
        self.device = decoder_device(self.session.get_providers(), self.session.get_provider_options())
        """(device type, device id) the outputs are bound on (:func:`decoder_device`)."""
        card = engine.card
        self._empty_shape = (card.kv_heads, 0, card.head_dim)
        self.kv_dtype = engine.kv_dtype
        """numpy type of the cache (the graph's past inputs: float32 or float16)."""
        self._h2d_bytes = self._d2h_bytes = self._prefills = self._decode_steps = self._tokens = 0

    @property
    def transfers(self) -> Transfers:
        """The host↔device traffic so far (:class:`Transfers`; warm-up steps included)."""
        kind, index = self.device
        return Transfers(
            f"{kind}:{index}" if kind != "cpu" else kind,
            self._h2d_bytes,
            self._d2h_bytes,
            self._prefills,
            self._decode_steps,
            self._tokens,
        )

    def _bind_input(self, binding: ort.IOBinding, name: str, array: Any) -> None:
        """Binds a host array (copied host→device on a GPU device) and counts its bytes."""
        contiguous = np.ascontiguousarray(array)
        binding.bind_cpu_input(name, contiguous)
        self._h2d_bytes += contiguous.nbytes

    def _fetch(self, value: ort.OrtValue) -> npt.NDArray[Any]:
        """An output as numpy (copied device→host on a GPU device), its bytes counted."""
        array = np.asarray(value.numpy())
        self._d2h_bytes += array.nbytes
        return array

    def _bind_common(self, binding: ort.IOBinding, ids: Any, mask: Any, positions: Any) -> None:
        self._bind_input(binding, "input_ids", ids)
        if self._has_mask:
            self._bind_input(binding, "attention_mask", mask)
        if self._has_positions:
            self._bind_input(binding, "position_ids", positions)
        kind, index = self.device
        binding.bind_output("logits", kind, index)
        for name in self.past_names:
            binding.bind_output(self.present_for[name], kind, index)

    @property
    def replays_graphs(self) -> bool:
        """True when decode steps are captured and replayed as CUDA graphs (only the in-place decoder's can be)."""
        return False

    @property
    def supports_prefix_reuse(self) -> bool:
        """True when the graph takes ``attention_mask`` and ``position_ids`` (a prefill that starts from a
        cached prefix needs both: its new tokens' positions do not start at 0)."""
        return self._has_mask and self._has_positions

    def prefill(self, prompts: list[list[int]], prefixes: Sequence[PrefixHit | None] | None = None) -> PrefillOutput:
        """One batched forward pass over whole prompts (right-padded).

        Without ``prefixes`` the cache starts empty. With them, row ``r`` whose ``prefixes[r]`` is a
        :class:`~workers.generation.prefix_cache.PrefixHit` of ``n`` tokens starts from that KV
        (right-aligned in the past, mask 0 before it) and computes only ``prompts[r][n:]``, at
        positions ``n`` onwards; rows without a hit have an empty (all-masked) past.
        """
        rows = len(prompts)
        reused = [hit.tokens if hit is not None else 0 for hit in prefixes] if prefixes else [0] * rows
        padded = pad_batch([p[n:] for p, n in zip(prompts, reused, strict=True)], self.engine.card.pad_token_id)
        past_width = max(reused)
        offsets = np.asarray(reused, dtype=np.int64)[:, None]
        mask = np.concatenate([right_aligned_mask(reused, past_width), padded.attention_mask], axis=1)
        positions = padded.position_ids + offsets * padded.attention_mask
        binding = self.session.io_binding()
        self._bind_common(binding, padded.input_ids, mask, positions)
        for name in self.past_names:
            past = np.zeros((rows, self._empty_shape[0], past_width, self._empty_shape[2]), dtype=self.kv_dtype)
            for row, hit in enumerate(prefixes or ()):
                if hit is not None:
                    past[row, :, past_width - hit.tokens :, :] = hit.kv[name]
            self._bind_input(binding, name, past)
        started = time.perf_counter()
        self.session.run_with_iobinding(binding, self.engine.run_options)
        engine_ms = (time.perf_counter() - started) * 1000
        logits_value, *presents = binding.get_outputs()
        logits = self._fetch(logits_value)
        computed = [len(p) - n for p, n in zip(prompts, reused, strict=True)]
        at = np.minimum(np.asarray(computed), logits.shape[1]) - 1  # an LM-head-last model gives [rows, 1, vocab]
        last = np.asarray(logits[np.arange(rows), at, :], dtype=np.float32)
        arrays = [self._fetch(v) for v in presents]
        self._prefills += 1
        self._tokens += rows
        caches = [
            {
                name: arr[r, :, past_width - reused[r] : past_width + computed[r], :]
                for name, arr in zip(self.past_names, arrays, strict=True)
            }
            for r in range(rows)
        ]
        lengths = [len(p) for p in prompts]
        return PrefillOutput(last, caches, lengths, padded.padded_tokens, engine_ms, reused)

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
                self._bind_input(binding, name, value)
            else:
                binding.bind_ortvalue_input(name, value)
        started = time.perf_counter()
        self.session.run_with_iobinding(binding, self.engine.run_options)
        engine_ms = (time.perf_counter() - started) * 1000
        logits_value, *presents = binding.get_outputs()
        logits = self._fetch(logits_value)[:, -1, :]
        self._d2h_bytes += state.fetched_bytes
        state.fetched_bytes = 0
        self._decode_steps += 1
        self._tokens += rows
        state.values = dict(zip(self.past_names, presents, strict=True))
        state.fetched = None
        state.mask = mask
        state.positions = state.positions + 1
        return np.asarray(logits, dtype=np.float32), engine_ms
