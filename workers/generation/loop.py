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

The cache is :mod:`~workers.generation.batch_kv`'s: in place (a slot per sequence in one buffer, nothing
moves when rows join or leave) when the worker serves the rewritten graph, else the graph's own
``Concat`` cache, re-laid out once per step when membership changes. Which waiting sequences may join is decided
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
from workers.generation.batch_kv import Prefilled, batch_kv_for
from workers.generation.decoder import Decoder
from workers.generation.prefill_queue import Joining, plan_chunks
from workers.generation.prefix_cache import PrefixCache
from workers.generation.sampling import greedy_rows
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
    prompt_tokens: int = 0
    """Prompt tokens of the sequences whose prefill completed in this step (their first token came): the sum
    of their results' ``usage.prompt_tokens``, prefix-cache tokens included."""
    kv_copied_bytes: int = 0
    """KV-cache bytes copied in this step (:attr:`~workers.generation.batch_kv.ConcatKV.copied_bytes`:
    re-layouts and the graph's Concat of the past; in place, only prefix-cache traffic)."""


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
        self.kv = batch_kv_for(decoder, batching.max_batch_size)
        """The running batch's KV cache (:mod:`workers.generation.batch_kv`)."""
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
        """Sequences still generating: running and not ended, or being prefilled (a chunk per step)."""
        return sum(1 for s in self.running if s.finish_reason is None) + len(self.joining)

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
        copied_before = self.kv.copied_bytes
        joiners = [s for s in joiners if not self._refuse_before_start(s, now)]
        finished: list[FinishReason] = []
        keep = [i for i, seq in enumerate(self.running) if not self._stopped(seq, now, finished)]
        for j in [j for j in self.joining if self._stopped(j.seq, now, finished)]:
            self.joining.remove(j)
            self.kv.drop(j)
        started = time.perf_counter()
        self._keep_leaving(set(keep))  # before the lookups: a next turn may join in this step
        self.kv.release_leaving(self.running, keep)  # before the joiners take slots
        copy_ms = (time.perf_counter() - started) * 1000
        fresh = [self._start_joining(seq) for seq in joiners]
        queue = self.joining + fresh
        takes = plan_chunks([j.remaining for j in queue], self.prefill_chunk_tokens)
        computing = [(j, take) for j, take in zip(queue, takes, strict=True) if take > 0]
        first_ms: list[float] = []
        prefill: Prefilled | None = None
        joined: list[int] = []
        completed: list[Joining] = []
        if computing:
            prefill = self.kv.prefill(computing)
            for row, (j, take) in enumerate(computing):
                j.started_mono = now if j.started_mono is None else j.started_mono
                j.engine_ms += prefill.engine_ms
                if take < j.remaining:  # a chunk: keep its KV for the next one
                    self.kv.chunk_done(j, prefill, row)
                    j.done += take
                    continue
                completed.append(j)
                seq = j.seq
                seq.note_prefill(j.started_mono, len(computing), prefill.padded_tokens, j.engine_ms)
                done = seq.accept(prefill.last_logits[row])
                first_ms.append((self.clock() - seq.arrived_s) * 1000)
                if done:
                    finished.append(seq.end().finish_reason)
                    self._keep_prefix(seq.prompt, self.kv.prompt_kv(j, prefill, row))
                    self.kv.ended_at_prefill(j)
                else:
                    joined.append(row)
        self.joining = [j for j in queue if j not in completed]
        if len(keep) != len(self.running) or joined:
            copy_ms += self.kv.settle(self.running, keep, prefill, joined)
            self.running = [self.running[i] for i in keep] + [computing[row][0].seq for row in joined]
        decode_ms, tokens = self._decode(finished)
        self.steps_run += 1
        stats = GenStepStats(
            running=tokens,
            joined=len(joined),
            kv_tokens=self.kv.kv_tokens(self.running),
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
            prompt_tokens=sum(len(j.seq.prompt) for j in completed),
            kv_copied_bytes=self.kv.copied_bytes - copied_before,
        )
        for observer in self.observers:
            try:
                observer(stats)
            except Exception:
                log.exception("generation observer failed")

    def _start_joining(self, seq: GenSequence) -> Joining:
        """A sequence admitted this step, starting from its longest cached prefix (when there is one)."""
        hit = self.prefix_cache.lookup(seq.prompt) if self.prefix_cache is not None else None
        joining = Joining(seq) if hit is None else Joining(seq, done=hit.tokens, reused=hit.tokens)
        seq.cached_tokens = joining.reused
        self.kv.start(joining, hit)
        return joining

    def _keep_prefix(self, tokens: list[int], kv: Mapping[str, npt.NDArray[np.float32]]) -> None:
        """Offer a leaving sequence's cache (``kv`` holds exactly ``tokens``) to the prefix cache."""
        if self.prefix_cache is not None:
            self.prefix_cache.insert(tokens, kv)

    def _keep_row(self, row: int) -> None:
        """Offer running row ``row``'s cache (it holds ``history[:positions[row]]``) to the prefix cache, once.

        Called as a sequence ends in a decode step, before its future resolves, so the prefix is held
        (and published for routing) before its caller can send the next turn."""
        seq = self.running[row]
        if self.prefix_cache is None or seq.kv_kept:
            return
        kv = self.kv.row_kv(self.running, row)
        if kv is None:
            return
        self._keep_prefix(seq.history[: self.kv.row_length(self.running, row)], kv)
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
        logits, decode_ms = self.kv.decode(self.running, tokens)
        argmax = [s.sampler.takes_argmax for s in self.running]
        picked = greedy_rows(logits) if any(argmax) else None  # one call, not a float64 copy and argmax per row
        for row, seq in enumerate(self.running):
            seq.note_decode(rows, decode_ms)
            if picked is not None and argmax[row]:
                ended = seq.accept_token(int(picked[row]))
            else:
                ended = seq.accept(logits[row])
            if ended:
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
            seq.future.set_exception(RequestCancelled.before_run(seq.request_id))
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
        self.kv.warm_up(self.max_batch_size, token)
        return (time.perf_counter() - started) * 1000

    def fail_all(self, exc: BaseException) -> None:
        """The engine failed: end every running (and joining) sequence with ``exc`` and reset the batch."""
        for seq in [*self.running, *(j.seq for j in self.joining)]:
            if not seq.future.done():
                seq.future.set_exception(exc)
        self.running = []
        self.joining = []
        self.kv.reset()

