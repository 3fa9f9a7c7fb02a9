"""OpenAI-compatible routes: the official SDKs work against ``base_url=http://<gateway>/v1``.

::

    POST /v1/completions        prompt (text or token ids) → text_completion   stream: SSE chunks
    POST /v1/chat/completions   messages → chat template → chat.completion    stream: SSE chunks
    POST /v1/embeddings         encoder models; float or base64 vectors
    GET  /v1/models             OpenAI's list; each entry also carries the fleet's view of the model
    GET  /v1/models/{model}     one entry

``/v1/models`` is both faces' model list: OpenAI's shape (``{"object": "list", "data": [{"id",
"object": "model", "created", "owned_by"}]}``) with the fleet's fields added to each entry (queue,
version, served_versions, ready, ready_workers, workers, queue_depth, max_queue_depth,
max_input_tokens, max_new_tokens); the SDKs keep extra keys as attributes.

Every call becomes ordinary fleet requests (:meth:`FleetClient.build_request`, then
:meth:`FleetClient.send` with admission control and the caller's rate bucket) and answers with
header ``X-Request-ID`` (embeddings: the IDs, comma-separated), so a call the gateway stops waiting
for (``WAIT_S``) can still be polled with ``GET /v1/requests/{id}``. A non-streaming call waits on
the event loop for the stored result (:mod:`gateway.outcomes`); a streaming one relays the
request's Redis Stream (``XREAD BLOCK`` on redis.asyncio) as OpenAI chunks and ends with
``data: [DONE]``. If the client disconnects before the end, streaming or not
(:mod:`gateway.disconnect`), the request is cancelled (``fleet:cancel:<id>`` + ``fleet:cancels``):
a queued one is never run, a running generation ends at its next step.
Mapping of fields and finish reasons: :mod:`gateway.openai_mapping`; building a generation:
:mod:`gateway.openai_generation`; waiting, and cancelling when the client leaves: :mod:`gateway.openai_waits`;
an embeddings call's requests: :mod:`gateway.openai_embeddings`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from functools import partial
from typing import Annotated, Any

import redis
from fastapi import APIRouter, Request, Response
from fastapi import Path as PathParam
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from gateway.deps import CallerDep, Gateway, GatewayDep
from gateway.disconnect import ClientLeft, unless_client_leaves
from gateway.errors import fleet_error_response, openai_error_of, relay_error
from gateway.native_submit import send_owned
from gateway.openai_embeddings import queue_embeddings
from gateway.openai_generation import build_generation, chat_prompt
from gateway.openai_mapping import (
    ChunkWriter,
    Face,
    chat_response,
    check_supported,
    completion_prompt,
    completion_response,
    embedding_list,
    input_field,
    max_tokens_field,
    prompt_field,
    rename_field,
)
from gateway.openai_schema import (
    ChatBody,
    ChatCompletion,
    CompletionBody,
    CompletionResponse,
    EmbeddingBody,
    EmbeddingList,
    ModelObject,
    ModelObjectList,
)
from gateway.openai_waits import CLIENT_CLOSED_REQUEST, cancel_requests, give_up_waiting, outcome_or_error
from gateway.outcomes import WAIT_S, await_outcomes, relay_unless_no_worker
from gateway.sse import DONE_FRAME, EventStream, sse_frame
from gateway.stream_relay import relay_event_batches
from producer.registry import read_fleet_state
from producer.submit_groups import SubmitItem
from protocol.errors import FleetError, NoLiveWorker, RequestNotFound, UnknownModel
from protocol.messages import InferenceRequest, InferenceResult

__all__ = [
    "CLIENT_CLOSED_REQUEST",
    "build_generation",
    "cancel_requests",
    "chat_prompt",
    "give_up_waiting",
    "outcome_or_error",
    "router",
]

router = APIRouter(tags=["openai"])
SSE: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {}}, "description": "with stream: true, SSE chunks"}
}


@router.post("/v1/completions", response_model=CompletionResponse, responses=SSE)
async def completions(body: CompletionBody, rate_key: CallerDep, gw: GatewayDep, http: Request) -> Response:
    """Complete one prompt (text or token ids); ``stream: true`` for SSE chunks."""
    check_supported(body)
    request = await run_in_threadpool(build_generation, gw, body, completion_prompt(body), prompt_field(body))
    return await _generate(gw, request, rate_key, "completion", body, http)


@router.post("/v1/chat/completions", response_model=ChatCompletion, responses=SSE)
async def chat_completions(body: ChatBody, rate_key: CallerDep, gw: GatewayDep, http: Request) -> Response:
    """Answer a conversation rendered with the model's chat template; ``stream: true`` for SSE chunks."""
    check_supported(body)
    prompt = await run_in_threadpool(chat_prompt, gw, body)
    request = await run_in_threadpool(build_generation, gw, body, prompt, "messages")
    return await _generate(gw, request, rate_key, "chat", body, http)


async def _generate(
    gw: Gateway, request: InferenceRequest, rate_key: str, face: Face, body: CompletionBody | ChatBody, http: Request
) -> Response:
    # OpenAI's ``user`` (an end-user ID) is the sticky key of a canary split; generations arriving together
    # are queued in one Redis step (gateway.submit_queue) and reach a worker together
    if gw.settings.api.group_submits:
        rid = (await gw.submits.submit(SubmitItem([request], rate_key, [body.user])))[0]
    else:
        rid = await run_in_threadpool(partial(send_owned, gw, request, rate_key=rate_key, routing_key=body.user))
    headers = {"X-Request-ID": rid}
    created = int(time.time())
    if body.stream:
        options = body.stream_options
        writer = ChunkWriter(face, rid, request.model, created, include_usage=bool(options and options.include_usage),
                             continuous_usage=bool(options and options.continuous_usage_stats),
                             prompt_tokens=len(request.input_ids))  # fmt: skip
        ended: list[bool] = []
        return EventStream(
            _frames(gw, rid, request.model, writer, ended), finished=lambda: bool(ended),
            on_abort=partial(cancel_requests, gw, [rid]),
            headers=headers,
        )
    asked = prompt_field(body) if isinstance(body, CompletionBody) else "messages"
    outcome = await outcome_or_error(gw, http, rid, request.model, headers,
                                     {"input_ids": asked, "max_new_tokens": max_tokens_field(body)})
    if isinstance(outcome, Response):
        return outcome
    make = completion_response if face == "completion" else chat_response
    try:
        answer = make(rid, request.model, created, outcome)  # the configured name, as /v1/models lists it
    except FleetError as exc:  # ids without text: say so, never answer ""
        return fleet_error_response(exc, openai=True, headers=headers)
    return JSONResponse(answer.model_dump(mode="json"), headers=headers)


async def _frames(gw: Gateway, rid: str, model: str, writer: ChunkWriter, ended: list[bool]) -> AsyncIterator[bytes]:
    """The SSE frames of one generation; ``ended`` gets an entry once the stream's end was read."""
    for payload in writer.opening():
        yield sse_frame(payload)
    # ends from the stored result if events were lost; silent with no worker of the model: bounded
    batches = relay_unless_no_worker(relay_event_batches(gw, rid), gw.fleet, gw.apresence, model,
                                     wait_s=gw.settings.api.no_worker_wait_s)
    try:
        async for batch in batches:  # one read's events: one write to the client
            frames: list[bytes] = []
            for event in batch:
                if event.is_last:
                    ended.append(True)
                frames.extend(sse_frame(payload) for payload in writer.on_event(event))
            if frames:
                yield b"".join(frames)
    except NoLiveWorker as exc:  # an error chunk naming the model; the request is cancelled
        ended.append(True)
        yield sse_frame(openai_error_of(await give_up_waiting(gw, [rid], exc)))
    except (FleetError, redis.RedisError) as exc:  # say so; leave the request be (it can be polled)
        ended.append(True)
        yield sse_frame(openai_error_of(relay_error(exc, rid)))
    yield DONE_FRAME


@router.post("/v1/embeddings", response_model=EmbeddingList)
async def embeddings(body: EmbeddingBody, rate_key: CallerDep, gw: GatewayDep, http: Request) -> Response:
    """One vector per input (text or token ids) from an encoder model; queued all or none."""
    check_supported(body)
    ids = await queue_embeddings(gw, body, rate_key)
    headers = {"X-Request-ID": ",".join(ids)}
    model = gw.settings.model_key(body.model)  # the configured name, as /v1/models lists it
    try:
        waiting = await_outcomes(gw.fleet, gw.aredis, ids, timeout_s=WAIT_S, model=model,
                                 no_worker_after_s=gw.settings.api.no_worker_wait_s, presence=gw.apresence,
                                 notifier=gw.results)
        outcomes = await unless_client_leaves(http, waiting, partial(cancel_requests, gw, ids))
    except ClientLeft:
        return Response(status_code=CLIENT_CLOSED_REQUEST, headers=headers)
    except NoLiveWorker as exc:
        return fleet_error_response(await give_up_waiting(gw, ids, exc), openai=True, headers=headers)
    except FleetError as exc:
        return fleet_error_response(exc, openai=True, headers=headers)
    results: list[InferenceResult] = []
    for i, rid in enumerate(ids):
        outcome = outcomes[rid]
        if isinstance(outcome, FleetError):
            named = rename_field(outcome, {"input_ids": input_field(body, i)})
            return fleet_error_response(named, openai=True, headers=headers)
        results.append(outcome)
    vectors = embedding_list(model, results, body.encoding_format)
    return JSONResponse(vectors.model_dump(mode="json"), headers=headers)


def _model_objects(gw: Gateway) -> list[ModelObject]:
    state = read_fleet_state(gw.settings, gw.fleet.redis)
    if state.redis_error:
        raise redis.ConnectionError(state.redis_error)
    out = []
    for m in state.models:
        spec = gw.settings.models[m.name]
        created = int(spec.path.stat().st_mtime) if spec.path.exists() else 0
        out.append(
            ModelObject(
                id=m.name,
                created=created,
                queue=m.queue,
                version=m.configured_version,
                served_versions=m.versions,
                ready=m.ready_workers > 0,
                ready_workers=m.ready_workers,
                workers=len(m.workers),
                queue_depth=m.depth,
                max_queue_depth=m.max_queue_depth,
                max_input_tokens=spec.limits.max_input_tokens,
                max_new_tokens=spec.limits.max_new_tokens,
            )
        )
    return out


@router.get("/v1/models", response_model=ModelObjectList, tags=["fleet"])
def models(_: CallerDep, gw: GatewayDep) -> ModelObjectList:
    """Every configured model, in OpenAI's list shape, with versions, readiness and queue depth."""
    return ModelObjectList(data=_model_objects(gw))


@router.get("/v1/models/{model}", response_model=ModelObject, tags=["fleet"])
def model(model: Annotated[str, PathParam(max_length=200)], _: CallerDep, gw: GatewayDep) -> ModelObject:
    """One configured model, named as every route names it (case and ``-``/``_`` do not matter; 404 when
    none has that name)."""
    try:
        key = gw.settings.model_key(model)
    except UnknownModel:
        key = None
    found = [m for m in _model_objects(gw) if m.id == key]
    if not found:
        raise RequestNotFound(f"no model {model!r} is configured; GET /v1/models lists them", "model", None)
    return found[0]
