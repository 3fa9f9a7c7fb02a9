"""The running batch's KV cache as the generation loop sees it: the graph's ``Concat`` cache or slots.

:class:`GenerationLoop <workers.generation.loop.GenerationLoop>` drives one of two implementations
with the same calls, in the order of a step: ``start`` a joiner (from its prefix-cache hit),
``prefill`` the joiners' chunks, ``settle`` membership (rows that leave, joiners that join), ``decode``
the running rows.

- :class:`ConcatKV`: the graph grows its cache with ``Concat``; rows are right-aligned in one tensor
  (:class:`~workers.generation.decoder.KVState`) and every membership change re-lays it out (a copy of
  every real entry), and every decode step copies the whole past inside the model.
- :class:`SlotKV`: the graph's attention is ``GroupQueryAttention`` on one preallocated buffer
  (:mod:`workers.generation.slots`, :mod:`tools.inplace_kv`); each sequence owns a slot from its first
  prefill to its end, so a join writes only the joiner's slot, a leave frees one, and a decode step
  copies no past (``copy_ms`` is 0; the only copies are prefix-cache hits written into a slot and
  ended sequences read out of it for the prefix cache, :attr:`SlotKV.copied_bytes`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from workers.generation.decoder import Decoder, KVState, PrefillOutput
from workers.generation.inplace_decoder import InPlaceDecoder
from workers.generation.kvcache import Cache
from workers.generation.prefill_queue import Joining
from workers.generation.prefix_cache import PrefixHit
from workers.generation.sequence import GenSequence
from workers.generation.slots import SlotCache, contiguous_runs

__all__ = ["BatchKV", "ConcatKV", "Prefilled", "SlotKV", "batch_kv_for"]

FloatArray = npt.NDArray[np.float32]
log = logging.getLogger("fleet.generation")


@dataclass
class Prefilled:
    """One step's prefill of the joiners' chunks."""

    last_logits: FloatArray
    """[computing rows, vocab] at each chunk's last token."""
    engine_ms: float
    padded_tokens: int
    output: PrefillOutput | None = None
    """The Concat cache's output (each row's real columns); None for slots."""


class ConcatKV:
    """The graph's own ``Concat`` cache (:class:`~workers.generation.decoder.KVState`)."""

    in_place = False

    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder
        self.state = KVState()
        self.copied_bytes = 0
        """Bytes of cache copied: re-layouts (every real entry of every kept row, per change) and the graph's
        ``Concat`` of the past into each step's present (rows x cache width, every decode step)."""

    def start(self, joining: Joining, hit: PrefixHit | None) -> None:
        if hit is not None:
            joining.kv = hit.kv

    def drop(self, joining: Joining) -> None:
        """A joiner left before joining (cancelled, past its deadline)."""

    def prefill(self, computing: Sequence[tuple[Joining, int]]) -> Prefilled:
        pasts = [j.past() for j, _ in computing]
        self.copied_bytes += len(computing) * max(j.done for j, _ in computing) * self._bytes_per_token()
        out = self.decoder.prefill([j.seq.prompt[: j.done + take] for j, take in computing],
                                   pasts if any(pasts) else None)  # fmt: skip
        return Prefilled(out.last_logits, out.engine_ms, out.padded_tokens, out)

    def chunk_done(self, joining: Joining, prefilled: Prefilled, row: int) -> None:
        """A chunk that did not finish its prompt: keep its KV for the next one."""
        assert prefilled.output is not None
        joining.kv = {name: np.array(arr) for name, arr in prefilled.output.caches[row].items()}

    def prompt_kv(self, joining: Joining, prefilled: Prefilled, row: int) -> Cache:
        """The whole prompt's KV of a sequence that ended with its first token (for the prefix cache)."""
        assert prefilled.output is not None
        return prefilled.output.caches[row]

    def ended_at_prefill(self, joining: Joining) -> None:
        """A sequence that ended with its first token never joins."""

    def release_leaving(self, running: Sequence[GenSequence], keep: list[int]) -> None:
        """Rows leave at :meth:`settle` (the re-layout)."""

    def settle(self, running: Sequence[GenSequence], keep: list[int], prefilled: Prefilled | None,
               joined: list[int]) -> float:
        """Rows ``keep`` of ``running`` stay, computing rows ``joined`` join; returns copy ms."""
        before = int(self.state.positions[keep].sum()) if self.state.rows and keep else 0
        ms = self.state.relayout(keep, prefilled.output if prefilled is not None else None, joined)
        self.copied_bytes += before * self._bytes_per_token()
        return ms

    def _bytes_per_token(self) -> int:
        card = self.decoder.engine.card
        return len(self.decoder.past_names) * card.kv_heads * card.head_dim * 4

    def decode(self, running: Sequence[GenSequence], tokens: list[int]) -> tuple[FloatArray, float]:
        """[rows, vocab] logits in ``running`` order, and engine ms."""
        self.copied_bytes += int(self.state.mask.size) * self._bytes_per_token()
        return self.decoder.decode(self.state, tokens)

    def row_kv(self, running: Sequence[GenSequence], row: int) -> Cache | None:
        """Running row ``row``'s real columns (``history[:length]``), or None when it has no row yet."""
        if row >= self.state.rows:
            return None
        return self.state.row_cache(self.state.fetch(), row)

    def row_length(self, running: Sequence[GenSequence], row: int) -> int:
        return int(self.state.positions[row])

    def kv_tokens(self, running: Sequence[GenSequence]) -> int:
        return self.state.kv_tokens

    def warm_up(self, rows: int, token: int) -> None:
        prefill = self.decoder.prefill([[token, token] for _ in range(rows)])
        state = KVState()
        state.relayout([], prefill, list(range(rows)))
        self.decoder.decode(state, [token] * rows)

    def reset(self) -> None:
        self.state = KVState()


class SlotKV:
    """The in-place cache: one slot per sequence in a preallocated buffer (:mod:`workers.generation.slots`)."""

    in_place = True

    def __init__(self, decoder: InPlaceDecoder, slots: int) -> None:
        self.decoder = decoder
        self.cache: SlotCache = decoder.new_cache(slots)
        card = decoder.engine.card
        log.info("model %s %s: in-place KV cache of %d slots x %d tokens, %.0f MiB reserved (pages are committed "
                 "as sequences write them)", card.name, card.version, slots, self.cache.capacity,
                 self.cache.nbytes / 2**20)

    @property
    def copied_bytes(self) -> int:
        """Bytes copied into or out of slots (prefix-cache hits in, ended sequences out); never a re-layout."""
        return self.cache.written_bytes + self.cache.read_bytes

    def start(self, joining: Joining, hit: PrefixHit | None) -> None:
        (joining.seq.slot,) = self.cache.take(1)
        if hit is not None:
            self.cache.write(joining.seq.slot, hit.kv)

    def drop(self, joining: Joining) -> None:
        self._release(joining.seq)

    def _release(self, seq: GenSequence) -> None:
        if seq.slot is not None:
            self.cache.release(seq.slot)
            seq.slot = None

    def prefill(self, computing: Sequence[tuple[Joining, int]]) -> Prefilled:
        """Prompts that start empty, one call per run of consecutive slots; continued ones one call each."""
        vocab = self.decoder.engine.card.vocab_size
        logits = np.zeros((len(computing), vocab), dtype=np.float32)
        engine_ms = 0.0
        padded = 0
        fresh = {j.seq.slot: row for row, (j, _) in enumerate(computing) if j.done == 0}
        for run in contiguous_runs([s for s in fresh if s is not None]):
            rows = [fresh[s] for s in run]
            got, ms, computed = self.decoder.prefill_first(
                self.cache, run, [computing[r][0].seq.prompt[: computing[r][1]] for r in rows])
            logits[rows] = got
            engine_ms += ms
            padded += computed
        for row, (j, take) in enumerate(computing):
            if j.done > 0:
                assert j.seq.slot is not None
                chunk = j.seq.prompt[j.done : j.done + take]
                logits[row], ms = self.decoder.prefill_after(self.cache, j.seq.slot, chunk)
                engine_ms += ms
                padded += take
        return Prefilled(logits, engine_ms, padded)

    def chunk_done(self, joining: Joining, prefilled: Prefilled, row: int) -> None:
        """The chunk's KV is already in the joiner's slot."""

    def prompt_kv(self, joining: Joining, prefilled: Prefilled, row: int) -> Cache:
        assert joining.seq.slot is not None
        return self.cache.read(joining.seq.slot, len(joining.seq.prompt))

    def ended_at_prefill(self, joining: Joining) -> None:
        self._release(joining.seq)

    def release_leaving(self, running: Sequence[GenSequence], keep: list[int]) -> None:
        """Frees the slots of the rows of ``running`` not in ``keep`` (before this step's joiners take theirs)."""
        kept = set(keep)
        for row, seq in enumerate(running):
            if row not in kept:
                self._release(seq)

    def settle(self, running: Sequence[GenSequence], keep: list[int], prefilled: Prefilled | None,
               joined: list[int]) -> float:
        """Nothing moves: the leaving rows' slots are free already, the joiners are in theirs."""
        started = time.perf_counter()
        self.release_leaving(running, keep)
        return (time.perf_counter() - started) * 1000

    def decode(self, running: Sequence[GenSequence], tokens: list[int]) -> tuple[FloatArray, float]:
        slots = [seq.slot for seq in running]
        logits, ms = self.decoder.decode_slots(self.cache, {s: t for s, t in zip(slots, tokens, strict=True)
                                                            if s is not None})
        rows = [s for s in slots if s is not None]
        if rows == list(range(len(logits))):  # running order is slot order (no free slot inside): no copy
            return logits, ms
        return logits[rows], ms

    def row_kv(self, running: Sequence[GenSequence], row: int) -> Cache | None:
        seq = running[row]
        if seq.slot is None:
            return None
        return self.cache.read(seq.slot, int(self.cache.lengths[seq.slot]))

    def row_length(self, running: Sequence[GenSequence], row: int) -> int:
        slot = running[row].slot
        return int(self.cache.lengths[slot]) if slot is not None else 0

    def kv_tokens(self, running: Sequence[GenSequence]) -> int:
        return int(sum(self.cache.lengths[s.slot] for s in running if s.slot is not None))

    def warm_up(self, rows: int, token: int) -> None:
        slots = self.cache.take(rows)
        try:
            self.decoder.prefill_first(self.cache, slots, [[token, token] for _ in slots])
            self.decoder.decode_slots(self.cache, {s: token for s in slots})
        finally:
            for slot in slots:
                self.cache.release(slot)

    def reset(self) -> None:
        self.cache.release_all()


BatchKV = ConcatKV | SlotKV


def batch_kv_for(decoder: Decoder, slots: int) -> BatchKV:
    """:class:`SlotKV` for an :class:`~workers.generation.inplace_decoder.InPlaceDecoder`, else :class:`ConcatKV`."""
    return SlotKV(decoder, slots) if isinstance(decoder, InPlaceDecoder) else ConcatKV(decoder)
