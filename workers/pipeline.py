"""The per-request pipeline shared by ``fleet.infer`` and ``fleet.infer_bulk``.

decode → check it is for this worker's model → deadline → validate against the model's limits →
hand to the scheduler (a one-step :class:`~workers.scheduler.Job` or a
:class:`~workers.generation.sequence.GenSequence`) → wait → encode the JSON result. A cancel read at take
refuses the request; one heard later ends a one-step job still waiting for its batch
(:mod:`workers.cancel_watch`) and a generation at its next step. Any
:class:`~protocol.errors.FleetError` becomes the request's FAILURE result; the worker goes on.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from functools import partial
from typing import Any

from broker import CANCEL_MARKS
from protocol.cancel_marks import note_taken_and_read
from protocol.errors import InvalidRequest, RequestCancelled, RequestExpired, UnknownModel
from protocol.messages import (
    Generation,
    GenerationParams,
    GenerationTimings,
    InferenceRequest,
    InferenceResult,
    OutputSpec,
    Timings,
    TopToken,
    Usage,
    decode_request,
)
from protocol.validation import CheckedInput, check_generation_room, check_input, resolve_output
from workers.generation.sequence import GenOutcome, GenSequence
from workers.runtime import WorkerRuntime
from workers.scheduler import Arrival, Job, JobResult, Role

__all__ = ["Prepared", "finish", "handle_request", "prepare"]


class Prepared:
    """A validated request handed to the scheduler, waiting for its share of a batch."""

    def __init__(
        self,
        request: InferenceRequest,
        checked: CheckedInput,
        kind: str,
        future: Future[JobResult] | Future[GenOutcome],
        seq: GenSequence | None = None,
    ) -> None:
        self.request = request
        self.checked = checked
        self.kind = kind
        self.future = future
        self.seq = seq
        """The generation (its ``served_version`` says which version it ran on); None for one-step jobs."""


def _check_generation(runtime: WorkerRuntime, output: OutputSpec, prompt_tokens: int) -> GenerationParams:
    """The generation's parameters, refused when this worker cannot serve them."""
    params = output.generation or GenerationParams()
    if runtime.scheduler.generation is None:
        raise InvalidRequest(
            f"model {runtime.model_key!r} cannot generate: it has no past_key_values inputs (export it with "
            "its KV cache, e.g. optimum's text-generation-with-past)",
            "output.kind",
            "next_token",
        )
    if params.stop and runtime.tokenizer is None:
        raise InvalidRequest(
            f"output.generation.stop needs text, and model {runtime.model_key!r} has no tokenizer; use stop_token_ids",
            "output.generation.stop",
            None,
        )
    check_generation_room(prompt_tokens, params.max_new_tokens, max_positions=runtime.card.max_positions,
                          max_kv_tokens=runtime.model.batching.max_kv_tokens)  # fmt: skip
    return params


def prepare(
    runtime: WorkerRuntime,
    payload: Any,
    arrival: Arrival | Any,
    *,
    request_id: str,
    cancelled: bool = False,
    role: Role = "stable",
) -> Prepared:
    """Decode and validate one request, then submit it to the scheduler through ``arrival``.

    ``role`` is the role of the queue it came from: a canary-queue request (one-step or generation)
    runs on the canary engine when this worker has one loaded, else on stable.

    Raises:
        FleetError: invalid, expired, cancelled, or meant for another model.
    """
    if cancelled:
        raise RequestCancelled.before_run(request_id)
    request = decode_request(payload)
    if runtime.settings.model_key(request.model) != runtime.model_key:
        raise UnknownModel(
            f"request for model {request.model!r} reached queue {runtime.queue}, which serves {runtime.model_key!r}",
            "model",
            runtime.model_key,
        )
    deadline_mono = None
    if request.deadline_unix_s is not None:
        remaining_s = request.deadline_unix_s - time.time()
        if remaining_s <= 0:
            raise RequestExpired(
                f"deadline passed {-remaining_s * 1000:.0f} ms before the request was dequeued; not run",
                "deadline_unix_s",
                request.deadline_unix_s,
            )
        deadline_mono = time.monotonic() + remaining_s
    limits = runtime.model.limits
    checked = check_input(list(request.input_ids), limits=limits, vocab_size=runtime.card.vocab_size,
                          max_positions=runtime.card.max_positions)  # fmt: skip
    output = resolve_output(request.output, model_kind=runtime.card.kind, limits=limits,
                            vocab_size=runtime.card.vocab_size)
    kind = output.kind or "next_token"
    if kind == "generate":
        params = _check_generation(runtime, output, len(checked.input_ids))
        seq = GenSequence(
            request_id=request_id,
            prompt=checked.input_ids,
            params=params,
            eos_ids=runtime.eos_token_ids,
            tokenizer=runtime.tokenizer,
            deadline_s=deadline_mono,
            emit=runtime.streams,
            role=role,
            submitted_unix_s=request.submitted_at_unix_s,
        )
        runtime.streams.watch(seq)
        submit_gen = getattr(arrival, "submit_generation", None)
        future: Future[Any] = (
            submit_gen(seq) if submit_gen is not None else runtime.scheduler.submit_generation(seq)
        )
        return Prepared(request, checked, kind, future, seq)
    job = Job(checked.input_ids, output, deadline_mono, role=role, submitted_unix_s=request.submitted_at_unix_s,
              request_id=request_id)
    job_future = arrival.submit(job)
    # a cancel heard while it waits for its batch ends it unrun (workers.cancel_watch); no Redis command
    runtime.streams.waiting.watch(request_id, job_future, partial(runtime.scheduler.cancel, job))
    return Prepared(request, checked, kind, job_future)


def _queue_wait_ms(request: InferenceRequest, batch_started_unix_s: float, fallback_ms: float) -> float:
    if request.submitted_at_unix_s is None:
        return fallback_ms
    return max(0.0, (batch_started_unix_s - request.submitted_at_unix_s) * 1000)


def _encode(
    runtime: WorkerRuntime,
    prepared: Prepared,
    *,
    request_id: str,
    worker: str,
    started_unix_s: float,
    batch_wait_ms: float,
    inference_ms: float,
    batch_size: int,
    padded_tokens: int,
    version: str,
    role: Role,
    **outputs: Any,
) -> dict[str, Any]:
    """The JSON result: what every kind shares (IDs, the version and role that computed it, input,
    timings) plus its ``outputs``."""
    request = prepared.request
    result = InferenceResult(
        request_id=request_id,
        model=runtime.model_key,
        version=version,
        role=role,
        kind=prepared.kind,  # type: ignore[arg-type]
        input_tokens=len(prepared.checked.input_ids),
        truncated=prepared.checked.truncated or request.truncated,
        timings=Timings(
            queue_wait_ms=round(_queue_wait_ms(request, started_unix_s, batch_wait_ms), 3),
            batch_wait_ms=round(batch_wait_ms, 3),
            inference_ms=round(inference_ms, 3),
            batch_size=batch_size,
            padded_tokens=padded_tokens,
            worker=worker,
            batch_started_unix_s=started_unix_s,
        ),
        **outputs,
    )
    return result.model_dump(mode="json")


def _generation(prepared: Prepared, done: GenOutcome) -> Generation:
    """A finished generation's output, its time to first token counted from the producer's submit."""
    request = prepared.request
    ttft_from = request.submitted_at_unix_s or (done.prefill_started_unix_s - done.batch_wait_ms / 1000)
    return Generation(
        token_ids=done.token_ids,
        text=done.text,
        finish_reason=done.finish_reason,
        usage=Usage(
            prompt_tokens=done.prompt_tokens,
            completion_tokens=len(done.token_ids),
            total_tokens=done.prompt_tokens + len(done.token_ids),
            cached_tokens=done.cached_tokens,
        ),
        timings=GenerationTimings(
            time_to_first_token_ms=round(max(0.0, (done.first_token_unix_s - ttft_from) * 1000), 3),
            mean_inter_token_ms=round(done.mean_inter_token_ms, 3),
            decode_steps=done.decode_steps,
            batch_size_min=done.batch_size_min,
            batch_size_mean=round(done.batch_size_mean, 3),
            batch_size_max=done.batch_size_max,
        ),
    )


def finish(runtime: WorkerRuntime, prepared: Prepared, *, request_id: str, worker: str) -> dict[str, Any]:
    """Wait for the request's batch (or its whole generation) and encode its JSON result.

    Re-raises the job's error.
    """
    done = prepared.future.result()
    ids = {"request_id": request_id, "worker": worker}
    if isinstance(done, GenOutcome):
        if runtime.prefix_holder is not None:  # the conversation is held (for routing) before its reply is stored
            runtime.prefix_holder.sync()
        return _encode(
            runtime, prepared, **ids, started_unix_s=done.prefill_started_unix_s, batch_wait_ms=done.batch_wait_ms,
            inference_ms=done.engine_ms, batch_size=done.prefill_batch_size,
            padded_tokens=done.prefill_padded_tokens, generation=_generation(prepared, done),
            version=(prepared.seq.served_version if prepared.seq is not None else "") or runtime.version,
            role=prepared.seq.served_role if prepared.seq is not None else "stable",
        )
    top = None
    if done.top_ids is not None and done.top_logprobs is not None:
        top = [TopToken(token_id=t, logprob=lp) for t, lp in zip(done.top_ids, done.top_logprobs, strict=True)]
    return _encode(
        runtime, prepared, **ids, started_unix_s=done.batch_started_unix_s, batch_wait_ms=done.batch_wait_ms,
        inference_ms=done.inference_ms, batch_size=done.batch_size, padded_tokens=done.padded_tokens,
        top_k=top, embedding=done.embedding, version=done.version or runtime.version, role=done.role,
    )


def handle_request(
    runtime: WorkerRuntime, payload: Any, *, request_id: str, worker: str, role: Role = "stable",
    started: bool = False,
) -> dict[str, Any]:
    """Serve one request end to end on this worker; returns the JSON result.

    A generation holds its token of the bucket until its last token. A failure of a request that
    asked to generate ends its stream with an error event, so stream readers never hang. ``started``:
    its STARTED state was stored (by ``worker``); while it runs, the heartbeat writes that and its submit
    marker back where Redis lost them (:mod:`workers.held_requests`).

    Raises:
        FleetError: the request is invalid, expired, cancelled, or meant for another model.
    """
    runtime.token_taken()
    try:
        with runtime.scheduler.arrival(request_id) as arrival:  # the task ID is the request ID
            cancelled = CANCEL_MARKS.take(request_id)  # read as the message was taken (broker.cancel_marks)
            if cancelled is None:
                life_s = runtime.settings.visibility_timeout_s
                cancelled = note_taken_and_read(runtime.redis, [request_id], life_s)[request_id]
            prepared = prepare(runtime, payload, arrival, request_id=request_id, cancelled=cancelled, role=role)
        runtime.held.hold(request_id, prepared.request, started_by=worker if started else None)
        return finish(runtime, prepared, request_id=request_id, worker=worker)
    except Exception as exc:
        runtime.streams.fail_if_generating(request_id, payload, exc)
        raise
    finally:
        runtime.held.release(request_id)
        runtime.streams.unwatch(request_id)
        runtime.token_returned()
