"""One generation job's state while it runs: tokens, sampler, text, stops, timings, and its events.

The scheduler thread is the only writer. A sequence publishes each token (and the final event) to its
``emit`` sink (:class:`StreamSink`: the worker's stream publisher), which must not block.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np
import numpy.typing as npt

from protocol.messages import FinishReason, GenerationParams, Usage
from protocol.streams import StreamEvent
from protocol.tokenization import IncrementalDetokenizer, Tokenizer
from workers.generation.sampling import Sampler
from workers.generation.stops import scan_stops

__all__ = ["GenOutcome", "GenSequence"]



class StreamSink(Protocol):
    """Where a streaming sequence's events go (:class:`workers.stream_publisher.StreamPublisher`); neither
    method may block."""

    def publish(self, request_id: str, event: StreamEvent) -> None:
        """An event of ``request_id``'s stream (its final event)."""

    def publish_token(self, request_id: str, index: int, token_id: int, text: str) -> None:
        """The ``index``-th token of ``request_id``'s stream and the text it adds."""


@dataclass(frozen=True)
class GenOutcome:
    """What the task thread gets back when its generation ends."""

    token_ids: list[int]
    text: str | None
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int
    """Of ``prompt_tokens``: those taken from the prefix cache (not computed)."""
    first_token_unix_s: float
    mean_inter_token_ms: float
    decode_steps: int
    batch_size_min: int
    batch_size_mean: float
    batch_size_max: int
    batch_wait_ms: float
    """Arrival at the scheduler → its prefill started (ms)."""
    prefill_batch_size: int
    prefill_padded_tokens: int
    engine_ms: float
    """Engine time of the steps it took part in (ms)."""
    prefill_started_unix_s: float


@dataclass(eq=False)
class GenSequence:
    """A generation request inside the worker."""

    request_id: str
    prompt: list[int]
    params: GenerationParams
    eos_ids: frozenset[int]
    tokenizer: Tokenizer | None = None
    deadline_s: float | None = None
    """Monotonic deadline (s): past it the sequence ends with finish_reason 'deadline'."""
    emit: StreamSink | None = None
    arrived_s: float = 0.0
    future: Future[GenOutcome] = field(default_factory=Future)
    cancel_requested: bool = False
    """Set (from any thread) to stop the sequence at the next step with finish_reason 'cancelled'."""
    role: Literal["stable", "canary"] = "stable"
    """The role of the queue it came from: a canary generation runs on the canary's loop when one is loaded."""
    submitted_unix_s: float | None = None
    """The producer's submit time (wall clock, s), for the per-version outcome stream."""
    served_version: str = ""
    """The model version of the loop it joined (set by the scheduler at admission)."""
    served_role: Literal["stable", "canary"] = "stable"
    """The role of the loop it joined (set by the scheduler at admission)."""

    def __post_init__(self) -> None:
        self.generated: list[int] = []
        self.sampler = Sampler(self.params)
        self._detok = IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else None
        self._shown = 0
        self._searched = 0
        self._cut: int | None = None
        self.finish_reason: FinishReason | None = None
        self._first_unix = 0.0
        self._last_mono = 0.0
        self._gaps_ms = 0.0
        self._sizes: list[int] = []
        self.engine_ms = 0.0
        self.batch_wait_ms = 0.0
        self.prefill_batch = 0
        self.prefill_padded = 0
        self.prefill_started_unix = 0.0
        self.cached_tokens = 0
        """Prompt tokens whose KV came from the prefix cache (set as it joins)."""
        self.kv_kept = False
        """Its cache was offered to the prefix cache (the generation loop does it once, as it ends)."""
        self.slot: int | None = None
        """Its slot of an in-place KV cache, from its first prefill to its end
        (:class:`~workers.generation.batch_kv.SlotKV`)."""

    @property
    def reserved_tokens(self) -> int:
        """KV-cache tokens this sequence may need at most (prompt + max_new_tokens)."""
        return len(self.prompt) + self.params.max_new_tokens

    @property
    def history(self) -> list[int]:
        """Prompt and generated ids (what the repetition penalty looks at)."""
        return self.prompt + self.generated

    def note_prefill(self, started_mono: float, batch: int, padded: int, engine_ms: float) -> None:
        """Record the prefill it joined through, once it is done (``started_mono``: when it began, monotonic s)."""
        self.batch_wait_ms = max(0.0, (started_mono - self.arrived_s) * 1000)
        self.prefill_batch, self.prefill_padded = batch, padded
        self.prefill_started_unix = time.time() - max(0.0, time.monotonic() - started_mono)  # when it began
        self.engine_ms += engine_ms

    def note_decode(self, batch: int, engine_ms: float) -> None:
        """Record a decode step it took part in."""
        self._sizes.append(batch)
        self.engine_ms += engine_ms

    @property
    def text(self) -> str:
        """Detokenized output so far (empty without a tokenizer)."""
        return self._detok.text if self._detok is not None else ""

    def accept(self, logits_row: npt.NDArray[np.floating]) -> bool:
        """Choose the next token from ``logits_row`` [vocab]; returns True when the sequence ended."""
        return self.accept_token(self.sampler.pick(logits_row, self.history))

    def accept_token(self, token: int) -> bool:
        """Take ``token`` (chosen by this sequence's sampler) as the next one; returns True when the
        sequence ended. A decode step that picks a whole batch's greedy tokens at once calls this."""
        now = time.monotonic()
        if not self.generated:
            self._first_unix = time.time()
        else:
            self._gaps_ms += (now - self._last_mono) * 1000
        self._last_mono = now
        self.generated.append(token)
        p = self.params
        if (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
            self.finish_reason = "stop"
        else:
            if self._detok is not None:
                self._detok.add(token)
            self._check_stop_strings()
        if self.finish_reason is None and len(self.generated) >= p.max_new_tokens:
            self.finish_reason = "length"
        if self.finish_reason is None:
            self._emit_token(token, self._release(final=False))
        else:
            self._emit_token(token, "")
        return self.finish_reason is not None

    def _check_stop_strings(self) -> None:
        if not self.params.stop or self._detok is None:
            return
        text = self._detok.text
        scan = scan_stops(text, self.params.stop, self._searched)
        self._searched = len(text)
        if scan.match_at is not None:
            self._cut = scan.match_at
            self.finish_reason = "stop"

    def _release(self, *, final: bool) -> str:
        """Text not yet shown that can be shown now (all of it, cut at a stop string, when final)."""
        text = self.text
        if final:
            end = self._cut if self._cut is not None else len(text)
        else:
            end = scan_stops(text, self.params.stop, len(text)).safe_end if self.params.stop else len(text)
        delta = text[self._shown : max(end, self._shown)]
        self._shown = max(end, self._shown)
        return delta

    def _emit_token(self, token: int, text: str) -> None:
        if self.emit is not None and self.params.stream:
            self.emit.publish_token(self.request_id, len(self.generated) - 1, token, text)

    def end(self, reason: FinishReason | None = None) -> GenOutcome:
        """Close the sequence (``reason`` overrides: cancelled, deadline), emit the final event and
        resolve its future; returns the outcome."""
        if reason is not None:
            self.finish_reason = reason
        if self._detok is not None:
            self._detok.flush()  # what it held back (an unfinished character, a run of byte pieces) can hold a stop
            if self._cut is None:  # string too: the scan covers it, so none reaches the result or the stream
                given = self.finish_reason
                self._check_stop_strings()
                if reason is not None:  # cancelled, deadline: said as such, the text cut all the same
                    self.finish_reason = given
        tail = self._release(final=True)
        final = self.finish_reason or "length"
        usage = Usage(
            prompt_tokens=len(self.prompt),
            completion_tokens=len(self.generated),
            total_tokens=len(self.prompt) + len(self.generated),
            cached_tokens=self.cached_tokens,
        )
        if self.emit is not None and self.params.stream:
            self.emit.publish(
                self.request_id,
                StreamEvent(type="final", index=len(self.generated), finish_reason=final, usage=usage, text=tail),
            )
        sizes = self._sizes or [self.prefill_batch or 1]
        outcome = GenOutcome(
            token_ids=list(self.generated),
            text=self.text[: self._shown] if self._detok is not None else None,
            finish_reason=final,
            prompt_tokens=len(self.prompt),
            cached_tokens=self.cached_tokens,
            first_token_unix_s=self._first_unix,
            mean_inter_token_ms=self._gaps_ms / (len(self.generated) - 1) if len(self.generated) > 1 else 0.0,
            decode_steps=len(self._sizes),
            batch_size_min=min(sizes),
            batch_size_mean=sum(sizes) / len(sizes),
            batch_size_max=max(sizes),
            batch_wait_ms=self.batch_wait_ms,
            prefill_batch_size=self.prefill_batch,
            prefill_padded_tokens=self.prefill_padded,
            engine_ms=self.engine_ms,
            prefill_started_unix_s=self.prefill_started_unix,
        )
        if not self.future.done():
            self.future.set_result(outcome)
        return outcome
