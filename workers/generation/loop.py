"""Continuous batching: the generation half of the scheduler's step.

Each :meth:`GenerationLoop.step` (run on the scheduler thread, never concurrently):

1. ends running (and joining) sequences that were cancelled or passed their deadline (their rows
   leave at once);
2. prefills the joiners the scheduler admitted, each from its longest cached prefix
   (:mod:`~workers.generation.prefix_cache`), in one batched, right-padded call of at most
   ``prefill_chunk_tokens`` prompt tokens (:mod:`~workers.generation.prefill_queue`: a longer prompt
   is prefilled a chunk per step), and samples the first token of each whose prompt is complete;
   those that are not finished by it join the running batch;
3. runs one decode step for every running sequence and samples each one's next token;
4. ends the finished ones (EOS, stop token or string, ``max_new_tokens``).

Membership changes re-lay out the KV cache once per step (:class:`~workers.generation.decoder.KVState`);
an unchanged batch keeps its cache inside ONNX Runtime. Which waiting sequences may join is decided
by :meth:`GenerationLoop.admissible`: FIFO, while the running set stays within ``max_batch_size``
sequences and the KV budget ``max_kv_tokens`` (each sequence reserves prompt + ``max_new_tokens``),
and the prefill within ``max_batch_tokens`` padded tokens. Static batching (``continuous`` off, for
the bench) admits only into an empty batch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from protocol.errors import RequestCancelled, RequestExpired
from protocol.messages import FinishReason
from protocol.settings import BatchingSettings
from workers.generation.decoder import Decoder, KVState
from workers.generation.prefill_queue import Joining, plan_chunks
from workers.generation.prefix_cache import PrefixCache
from workers.generation.sequence import GenSequence

__all__ = ["GenStepStats", "GenerationLoop"]

log = logging.getLogger("fleet.generation")


@dataclass(frozen=True)
class GenStepStats:
    """What observers (metrics, bench) learn about each generation step."""

    running: int
    """Sequences decoded in this step."""
    joined: int
    kv_tokens: int
    """Real tokens in the running batch's cache after the step."""
    prefill_ms: float
    decode_ms: float
    copy_ms: float
    """Time spent re-laying out the cache for membership changes (ms)."""
    tokens: int
    """Tokens produced in this step (prefill first tokens + decode tokens)."""
    finished: tuple[FinishReason, ...]
    first_token_ms: tuple[float, ...]
    """Producer submit → first token, for each joiner that got its first token in this step (ms)."""
    reused_tokens: int = 0
    """Prompt tokens of this step's joiners taken from the prefix cache (not computed)."""
    prefix_lookups: int = 0
    """Joiners looked up in the prefix cache (0 when it is off)."""
    prefix_hits: int = 0
    """Joiners that started from a cached prefix."""
    prefill_tokens: int = 0
    """Prompt tokens computed by this step's prefill (at most ``prefill_chunk_tokens`` when set)."""


class GenerationLoop:
    """Running set + KV cache of one worker's generations."""

    def __init__(
        self, decoder: Decoder, batching: BatchingSettings, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.decoder = decoder
        self.max_batch_size = batching.max_batch_size
        self.max_kv_tokens = batching.max_kv_tokens
        self.max_prefill_tokens = batching.max_batch_tokens
        self.continuous = batching.continuous
        self.clock = clock
        self.running: list[GenSequence] = []
        self.joining: list[Joining] = []
        """Admitted sequences whose prompt is being prefilled, a chunk per step
        (:mod:`workers.generation.prefill_queue`)."""
        self.prefill_chunk_tokens = batching.prefill_chunk_tokens
        self.state = KVState()
        self.observers: list[Callable[[GenStepStats], None]] = []
        self.steps_run = 0
        self.prefix_cache = (
            PrefixCache(batching.prefix_cache_bytes, batching.prefix_block_tokens)
            if batching.prefix_cache_bytes > 0 and decoder.supports_prefix_reuse
            else None
        )
        """The KV of finished sequences by token prefix (:mod:`workers.generation.prefix_cache`);
        None when ``prefix_cache_bytes`` is 0 or the graph cannot start from a past."""

    @property
    def active(self) -> int:
        """Sequences still generating."""
        return sum(1 for s in self.running if s.finish_reason is None)

    def has_work(self) -> bool:
        """True while any sequence runs (or a finished one still holds a row) or is being prefilled."""
        return bool(self.running or self.joining)

    def admissible(self, waiting: Sequence[GenSequence]) -> int:
        """How many of the oldest ``waiting`` sequences may join at the next step (pure)."""
        live = [s for s in self.running if s.finish_reason is None] + [j.seq for j in self.joining]
        if not waiting or (live and not self.continuous):
            return 0
        slots = self.max_batch_size - len(live)
        budget = self.max_kv_tokens - sum(s.reserved_tokens for s in live)
        count = longest = 0
        for seq in waiting[: max(0, slots)]:
            longest = max(longest, len(seq.prompt))
            if seq.reserved_tokens > budget or (count and (count + 1) * longest > self.max_prefill_tokens):
                break
            budget -= seq.reserved_tokens
            count += 1
        if count == 0 and not live:
            count = 1  # an empty batch always takes the oldest (its size was checked at submit)
        return count

    def step(self, joiners: list[GenSequence]) -> None:
        """One generation step (see the module docstring)."""
        now = self.clock()
        joiners = [s for s in joiners if not self._refuse_before_start(s, now)]
        finished: list[FinishReason] = []
        keep = [i for i, seq in enumerate(self.running) if not self._stopped(seq, now, finished)]
        self.joining = [j for j in self.joining if not self._stopped(j.seq, now, finished)]
        started = time.perf_counter()
        self._keep_leaving(set(keep))  # before the lookups: a next turn may join in this step
        copy_ms = (time.perf_counter() - started) * 1000
        fresh = [self._start_joining(seq) for seq in joiners]
        queue = self.joining + fresh
        takes = plan_chunks([j.remaining for j in queue], self.prefill_chunk_tokens)
        computing = [(j, take) for j, take in zip(queue, takes, strict=True) if take > 0]
        first_ms: list[float] = []
        prefill = None
        joined: list[int] = []
        completed: list[Joining] = []
        if computing:
            pasts = [j.past() for j, _ in computing]
            prefill = self.decoder.prefill([j.seq.prompt[: j.done + take] for j, take in computing],
                                           pasts if any(pasts) else None)  # fmt: skip
            for row, (j, take) in enumerate(computing):
                j.started_mono = now if j.started_mono is None else j.started_mono
                j.engine_ms += prefill.engine_ms
                if take < j.remaining:  # a chunk: keep its KV for the next one
                    j.kv = {name: np.array(arr) for name, arr in prefill.caches[row].items()}
                    j.done += take
                    continue
                completed.append(j)
                seq = j.seq
                seq.note_prefill(j.started_mono, len(computing), prefill.padded_tokens, j.engine_ms)
                done = seq.accept(prefill.last_logits[row])
                first_ms.append((self.clock() - seq.arrived_s) * 1000)
                if done:
                    finished.append(seq.end().finish_reason)
                    self._keep_prefix(seq.prompt, prefill.caches[row])
                else:
                    joined.append(row)
        self.joining = [j for j in queue if j not in completed]
        if len(keep) != len(self.running) or joined:
            copy_ms += self.state.relayout(keep, prefill, joined)
            self.running = [self.running[i] for i in keep] + [computing[row][0].seq for row in joined]
        decode_ms, tokens = self._decode(finished)
        self.steps_run += 1
        stats = GenStepStats(
            running=tokens,
            joined=len(joined),
            kv_tokens=self.state.kv_tokens,
            prefill_ms=prefill.engine_ms if prefill is not None else 0.0,
            decode_ms=decode_ms,
            copy_ms=copy_ms,
            tokens=tokens + len(completed),
            reused_tokens=sum(j.reused for j in fresh),
            prefix_lookups=len(fresh) if self.prefix_cache is not None else 0,
            prefix_hits=sum(1 for j in fresh if j.reused),
            finished=tuple(finished),
            first_token_ms=tuple(first_ms),
            prefill_tokens=sum(take for _, take in computing),
        )
        for observer in self.observers:
            try:
                observer(stats)
            except Exception:
                log.exception("generation observer failed")

    def _start_joining(self, seq: GenSequence) -> Joining:
        """A sequence admitted this step, starting from its longest cached prefix (when there is one)."""
        hit = self.prefix_cache.lookup(seq.prompt) if self.prefix_cache is not None else None
        if hit is None:
            return Joining(seq)
        return Joining(seq, done=hit.tokens, kv=hit.kv, reused=hit.tokens)

    def _keep_prefix(self, tokens: list[int], kv: Mapping[str, npt.NDArray[np.float32]]) -> None:
        """Offer a leaving sequence's cache (``kv`` holds exactly ``tokens``) to the prefix cache."""
        if self.prefix_cache is not None:
            self.prefix_cache.insert(tokens, kv)

    def _keep_row(self, row: int) -> None:
        """Offer running row ``row``'s cache (it holds ``history[:positions[row]]``) to the prefix cache, once.

        Called as a sequence ends in a decode step, before its future resolves, so the prefix is held
        (and published for routing) before its caller can send the next turn."""
        seq = self.running[row]
        if self.prefix_cache is None or seq.kv_kept or row >= self.state.rows:
            return
        size = int(self.state.positions[row])
        self._keep_prefix(seq.history[:size], self.state.row_cache(self.state.fetch(), row))
        seq.kv_kept = True

    def _keep_leaving(self, keep: set[int]) -> None:
        """Offer the cache of every running row not in ``keep`` (cancelled, past its deadline) to the
        prefix cache, unless it was offered as it ended."""
        for row in range(len(self.running)):
            if row not in keep:
                self._keep_row(row)

    def _decode(self, finished: list[FinishReason]) -> tuple[float, int]:
        """One decode step for the running batch; ends finished sequences. Returns (ms, rows)."""
        rows = len(self.running)
        if not rows:
            return 0.0, 0
        tokens = [s.generated[-1] for s in self.running]
        logits, decode_ms = self.decoder.decode(self.state, tokens)
        for row, seq in enumerate(self.running):
            seq.note_decode(rows, decode_ms)
            if seq.accept(logits[row]):
                self._keep_row(row)
                finished.append(seq.end().finish_reason)
        return decode_ms, rows

    def _stopped(self, seq: GenSequence, now: float, finished: list[FinishReason]) -> bool:
        """True when ``seq`` must leave now: it ended last step, was cancelled, or passed its deadline.

        Rows of sequences that ended in a decode step stay until the next step, so that their
        removal and the next joiners cost one cache re-layout, not two.
        """
        if seq.finish_reason is not None:
            return True
        reason: FinishReason | None = None
        if seq.cancel_requested:
            reason = "cancelled"
        elif seq.deadline_s is not None and now > seq.deadline_s:
            reason = "deadline"
        if reason is None:
            return False
        seq.end(reason)
        finished.append(reason)
        return True

    @staticmethod
    def _refuse_before_start(seq: GenSequence, now: float) -> bool:
        """Cancelled or expired before its prefill: fails like a one-step request would."""
        if seq.cancel_requested:
            seq.future.set_exception(
                RequestCancelled(f"request {seq.request_id} was cancelled before it ran", "request_id", None)
            )
            return True
        if seq.deadline_s is not None and now > seq.deadline_s:
            seq.future.set_exception(
                RequestExpired(
                    f"deadline passed {1000 * (now - seq.deadline_s):.0f} ms before compute; not run",
                    "deadline_unix_s",
                    None,
                )
            )
            return True
        return False

    def warm_up(self) -> float:
        """One prefill and one decode step at ``max_batch_size`` rows (before the worker consumes, so a
        model whose cache does not round-trip fails at start, and TensorRT has seen the decode shapes).
        Returns the time it took (ms)."""
        started = time.perf_counter()
        token = min(self.decoder.engine.card.vocab_size - 1, 3)
        rows = list(range(self.max_batch_size))
        prefill = self.decoder.prefill([[token, token] for _ in rows])
        state = KVState()
        state.relayout([], prefill, rows)
        self.decoder.decode(state, [token for _ in rows])
        return (time.perf_counter() - started) * 1000

    def fail_all(self, exc: BaseException) -> None:
        """The engine failed: end every running (and joining) sequence with ``exc`` and reset the batch."""
        for seq in [*self.running, *(j.seq for j in self.joining)]:
            if not seq.future.done():
                seq.future.set_exception(exc)
        self.running = []
        self.joining = []
        self.state = KVState()

