"""OpenAI's Responses API on the gateway, as the official SDKs' ``client.responses`` call it.

::

    POST   /v1/responses                      create (``stream: true`` for Responses SSE events)
    GET    /v1/responses/{id}                 a stored response
    DELETE /v1/responses/{id}                 delete it
    GET    /v1/responses/{id}/input_items     its input items (``limit``, ``order``, ``after``)

A create is a chat completion (:mod:`gateway.openai_routes`: the model's chat template, one fleet
request, the same waits, cancels and errors) over ``instructions`` + the stored history of
``previous_response_id`` + ``input`` (:mod:`gateway.responses_schema`). With ``store`` (default
true) the answer is kept in Redis for ``api.responses_ttl_s`` (:mod:`gateway.responses_store`), so any
gateway process retrieves it or continues the conversation. ``usage.input_tokens`` is the whole
rendered prompt, history included. The response's ID is ``resp_<request ID>`` (``X-Request-ID``
names the fleet request, pollable with ``GET /v1/requests/{id}``). An unknown, deleted or expired
``previous_response_id`` is a 404 in OpenAI's error shape, naming ``previous_response_id``; one still queued or
running a 400. A turn cancelled mid-way by another caller is answered ``cancelled`` (streamed: an ``error``
event) and not stored.

A stored response belongs to the API key that created it (:func:`gateway.auth.owner_of`; while auth is off, to
everyone): to any other key, ``GET``, ``input_items``, ``DELETE`` and ``previous_response_id`` answer the 404 of
an unknown ID, a turn still running included. A response is readable by the key that created it only: after a
key is rotated out, the new key does not see what the old one stored.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from functools import partial
from typing import Annotated, Any, Literal

import redis
from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi import Path as PathParam
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from gateway.auth import API_KEY_HEADER, key_from_headers, owner_of
from gateway.deps import CallerDep, Gateway, GatewayDep
from gateway.errors import fleet_error_response, openai_error_of, relay_error
from gateway.native_submit import send_owned
from gateway.openai_generation import build_generation, chat_prompt
from gateway.openai_mapping import finish_reason, rename_field, stream_error
from gateway.openai_schema import ChatBody
from gateway.openai_waits import cancel_requests, give_up_waiting, outcome_or_error
from gateway.outcomes import relay_unless_no_worker
from gateway.plain_numbers import DIGIT_COUNT
from gateway.responses_schema import ResponseBody, check_supported, input_messages, message_item, output_message
from gateway.responses_store import (
    StoredResponse,
    claim_response,
    delete_response,
    drop_claim,
    load_response,
    not_found,
    save_response,
    turn_claimed,
)
from gateway.sse import EventStream
from gateway.stream_relay import relay_events
from gateway.views import read_view
from producer.results import RequestStatus
from protocol.errors import FleetError, InvalidRequest, NoLiveWorker
from protocol.messages import InferenceRequest, Usage

__all__ = ["router"]

log = logging.getLogger("fleet.api")

router = APIRouter(tags=["openai"])
FIELD_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens"}
"""The chat face's field names → the Responses API's, in errors."""


async def _owner(http: Request, gw: GatewayDep) -> str:
    """Who owns the responses this call stores or reads: the accepted key's digest (:func:`gateway.auth.owner_of`;
    the key is the one :class:`gateway.body_guard.RequestGuardMiddleware` and :data:`CallerDep` accepted, read
    from the same headers in the same order)."""
    return owner_of(key_from_headers(http.headers.get(API_KEY_HEADER), http.headers.get("authorization")), gw.keys)


OwnerDep = Annotated[str, Depends(_owner)]


class _Turn:
    """One create call: what it asked, the conversation it renders, and how its answer is stored."""

    def __init__(
        self,
        body: ResponseBody,
        rid: str,
        model: str,
        history: list[dict[str, str]],
        new: list[dict[str, str]],
        owner: str,
    ) -> None:
        self.body = body
        self.rid = rid
        self.owner = owner  # gateway.auth.owner_of the caller: stored with the answer
        self.stored = body.store is not False
        self.model = model  # the configured name, as /v1/models lists it (the body may spell it otherwise)
        self.id = f"resp_{rid}"
        self.created = int(time.time())
        self.before = history + new  # the conversation without instructions: what the next turn continues
        self.input_items = [message_item(f"msg_{rid}_in{i}", m) for i, m in enumerate(self.before)]

    def response(self, status: str, text: str | None, usage: Usage | None, reason: str | None) -> dict[str, Any]:
        """The response object (``status`` in_progress, completed, incomplete or cancelled)."""
        b = self.body
        item_status = "incomplete" if status == "cancelled" else status  # an output item is never "cancelled"
        output = [] if text is None else [output_message(f"msg_{self.rid}", text, item_status)]
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "completed_at": int(time.time()) if status != "in_progress" else None, "error": None,
            "incomplete_details": incomplete, "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
            "model": self.model, "output": output, "parallel_tool_calls": False,
            "previous_response_id": b.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": b.store is not False, "temperature": b.temperature, "text": {"format": {"type": "text"}},
            "tool_choice": "none", "tools": [], "top_p": b.top_p, "truncation": "disabled", "user": b.user,
            "metadata": b.metadata or {}, "usage": _usage(usage) if usage is not None else None,
        }  # fmt: skip

    def finished(
        self, text: str, usage: Usage | None, fleet_reason: Any
    ) -> tuple[dict[str, Any], StoredResponse | None]:
        """The final response object and the document that stores it; None for a turn cancelled mid-way
        (``DELETE /v1/requests/{id}``, ``fleet cancel``): its half answer is no conversation to continue."""
        if fleet_reason == "cancelled":
            return self.response("cancelled", text, usage, fleet_reason), None
        status = "incomplete" if finish_reason(fleet_reason) == "length" else "completed"
        answer = self.response(status, text, usage, fleet_reason)
        history = [*self.before, {"role": "assistant", "content": text}]
        return answer, StoredResponse(response=answer, history=history, input_items=self.input_items, owner=self.owner)


def _usage(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }  # fmt: skip


def _as_chat(body: ResponseBody, messages: list[dict[str, str]]) -> ChatBody:
    """The chat completion this turn is (its sampling fields; only those the caller set)."""
    fields: dict[str, Any] = {"model": body.model, "messages": messages, "stream": bool(body.stream), "user": body.user}
    for ours, theirs in (("max_output_tokens", "max_completion_tokens"), ("temperature", "temperature"),
                         ("top_p", "top_p")):  # fmt: skip
        if getattr(body, ours) is not None:
            fields[theirs] = getattr(body, ours)
    return ChatBody.model_validate(fields)


def _build_turn(gw: Gateway, chat: ChatBody) -> InferenceRequest:
    """Render, tokenize and validate the turn (in a worker thread), errors named as the Responses API names
    the fields (``input``, ``max_output_tokens``)."""
    try:
        return build_generation(gw, chat, chat_prompt(gw, chat), "messages")
    except InvalidRequest as exc:
        raise rename_field(exc, FIELD_NAMES) from exc


async def _history_of(gw: Gateway, response_id: str, owner: str) -> list[dict[str, str]]:
    """The stored conversation of ``owner``'s that ``previous_response_id`` continues.

    Raises:
        RequestNotFound: none is stored (never, deleted, expired, another owner's); field
            ``previous_response_id`` (404).
        InvalidRequest: its turn (``owner``'s, stored once it ends) is still queued or running; same field.
    """
    previous = await load_response(gw.aredis, response_id, owner)
    if previous is not None:
        return previous["history"]
    rid = response_id.removeprefix("resp_")
    if rid != response_id and rid and await turn_claimed(gw.aredis, response_id, owner):
        try:
            status = (await read_view(gw.fleet, gw.aredis, rid))[0].status
        except FleetError:  # never submitted, expired, or a result that does not decode: not in progress
            status = RequestStatus.NOT_FOUND
        if status in (RequestStatus.QUEUED, RequestStatus.RUNNING):
            raise InvalidRequest(f"previous_response_id {response_id!r} is still {status}: a response is stored, "
                                 "and can be continued, once it has ended", "previous_response_id", None)  # fmt: skip
    raise not_found(response_id, "previous_response_id")


@router.post("/v1/responses")
async def create_response(
    body: ResponseBody, rate_key: CallerDep, owner: OwnerDep, gw: GatewayDep, http: Request
) -> Response:
    """Answer ``input`` after ``instructions`` and the stored conversation of ``previous_response_id``."""
    check_supported(body)
    new = input_messages(body)
    history = [] if body.previous_response_id is None else await _history_of(gw, body.previous_response_id, owner)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    chat = _as_chat(body, system + history + new)
    request = await run_in_threadpool(_build_turn, gw, chat)
    rid = await run_in_threadpool(partial(send_owned, gw, request, rate_key=rate_key, routing_key=body.user))
    turn = _Turn(body, rid, request.model, history, new, owner)
    if turn.stored:  # before anyone is told the ID: the owner's turn, "still running" to the owner alone
        await claim_response(gw.aredis, turn.id, owner, gw.settings.api.responses_ttl_s)
    headers = {"X-Request-ID": rid}
    if body.stream:
        ended: list[bool] = []
        return EventStream(_events(gw, turn, request.model, ended), finished=lambda: bool(ended),
                           on_abort=partial(cancel_requests, gw, [rid]), headers=headers)  # fmt: skip
    saved = False
    try:
        outcome = await outcome_or_error(gw, http, rid, request.model, headers, FIELD_NAMES)
        if isinstance(outcome, Response):
            return outcome
        gen = outcome.generation
        if gen is None or gen.text is None:
            return fleet_error_response(FleetError(f"request {rid} returned no text", "tokenizer"), openai=True,
                                        headers=headers)  # fmt: skip
        answer, doc = turn.finished(gen.text, gen.usage, gen.finish_reason)
        saved = await _save(gw, turn, doc)
        return JSONResponse(answer, headers=headers)
    finally:
        if not saved:
            await _unclaim(gw, turn)


async def _save(gw: Gateway, turn: _Turn, doc: StoredResponse | None) -> bool:
    """Store ``doc`` (replacing the turn's claim) when the turn is stored and ended well; whether it was."""
    if doc is None or not turn.stored:
        return False
    await save_response(gw.aredis, doc, gw.settings.api.responses_ttl_s)
    return True


async def _unclaim(gw: Gateway, turn: _Turn) -> None:
    """Drop the claim of a turn that ended unstored (a failure here only leaves it to expire)."""
    if not turn.stored:
        return
    try:
        await drop_claim(gw.aredis, turn.id)
    except redis.RedisError as exc:  # the claim expires with api.responses_ttl_s; it names no answer
        log.warning("could not drop the claim of %s: %s", turn.id, type(exc).__name__)


def _event(kind: str, seq: list[int], **fields: Any) -> bytes:
    """One Responses SSE frame (``event:`` + ``data:``) with the next ``sequence_number``."""
    payload = {"type": kind, "sequence_number": len(seq), **fields}
    seq.append(1)
    return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


async def _events(gw: Gateway, turn: _Turn, model: str, ended: list[bool]) -> AsyncIterator[bytes]:
    """The Responses events of one streamed turn; stored (with ``store``) before ``response.completed``."""
    saved = [False]
    try:
        async with aclosing(_turn_events(gw, turn, model, ended, saved)) as frames:  # closed now: its Redis reads too
            async for frame in frames:
                yield frame
    finally:  # ended unstored (failed, cancelled, left): its claim goes
        if not saved[0]:
            await _unclaim(gw, turn)


async def _turn_events(
    gw: Gateway, turn: _Turn, model: str, ended: list[bool], saved: list[bool]
) -> AsyncGenerator[bytes, None]:
    """:func:`_events` less the claim's end; ``saved`` gets True once the answer is stored."""
    seq: list[int] = []
    item_id = f"msg_{turn.rid}"
    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
    yield _event("response.created", seq, response=turn.response("in_progress", None, None, None))
    yield _event("response.in_progress", seq, response=turn.response("in_progress", None, None, None))
    item = output_message(item_id, "", "in_progress") | {"content": []}
    yield _event("response.output_item.added", seq, output_index=0, item=item)
    empty = {"type": "output_text", "text": "", "annotations": []}
    yield _event("response.content_part.added", seq, **where, part=empty)
    texts: list[str] = []
    events = relay_unless_no_worker(relay_events(gw, turn.rid), gw.fleet, gw.apresence, model,
                                    wait_s=gw.settings.api.no_worker_wait_s)  # fmt: skip
    try:
        async for event in events:
            if event.text and event.type != "error":
                texts.append(event.text)
                yield _event("response.output_text.delta", seq, **where, delta=event.text, logprobs=[])
            if event.type == "error":
                ended.append(True)
                err = stream_error(event)  # code: the fleet's (expired), not the worker's class name
                yield _event("error", seq, code=err["code"], message=err["message"], param=err["param"])
                return
            if event.type == "final":
                ended.append(True)
                answer, doc = turn.finished("".join(texts), event.usage, event.finish_reason)
                if doc is None:  # no Responses event ends a cancelled stream: say so as a failure
                    yield _event("error", seq, code="cancelled", param=None,
                                 message=f"request {turn.rid} was cancelled before it finished; not stored")
                    return
                saved[0] = await _save(gw, turn, doc)
                for frame in _closing(answer, where, seq):
                    yield frame
                return
    except NoLiveWorker as exc:  # an error event naming the model; the request is cancelled
        ended.append(True)
        err = openai_error_of(await give_up_waiting(gw, [turn.rid], exc))["error"]
        yield _event("error", seq, code=err["code"], message=err["message"], param=err["param"])
    except (FleetError, redis.RedisError) as exc:  # say so; leave the request be (it can be polled)
        ended.append(True)
        err = openai_error_of(relay_error(exc, turn.rid))["error"]
        yield _event("error", seq, code=err["code"], message=err["message"], param=err["param"])


def _closing(answer: dict[str, Any], where: dict[str, Any], seq: list[int]) -> list[bytes]:
    """The events that end a streamed turn: its text, part and item done, then ``response.<status>``."""
    part = answer["output"][0]["content"][0]
    return [
        _event("response.output_text.done", seq, **where, text=part["text"], logprobs=[]),
        _event("response.content_part.done", seq, **where, part=part),
        _event("response.output_item.done", seq, output_index=0, item=answer["output"][0]),
        _event(f"response.{answer['status']}", seq, response=answer),
    ]


ResponseId = Annotated[str, PathParam(max_length=200)]


async def _stored(gw: Gateway, response_id: str, owner: str) -> StoredResponse:
    doc = await load_response(gw.aredis, response_id, owner)
    if doc is None:
        raise not_found(response_id)
    return doc


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: ResponseId, _: CallerDep, owner: OwnerDep, gw: GatewayDep) -> dict[str, Any]:
    """A stored response of the caller's key (404 once deleted, past ``api.responses_ttl_s``, or another key's)."""
    return (await _stored(gw, response_id, owner))["response"]


@router.delete("/v1/responses/{response_id}")
async def remove_response(response_id: ResponseId, _: CallerDep, owner: OwnerDep, gw: GatewayDep) -> dict[str, Any]:
    """Delete a stored response of the caller's key (another key's: 404, kept); a turn that names it as
    ``previous_response_id`` gets a 404 after."""
    if not await delete_response(gw.aredis, response_id, owner):
        raise not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(
    response_id: ResponseId,
    _: CallerDep,
    owner: OwnerDep,
    gw: GatewayDep,
    limit: Annotated[int, Query(ge=1, le=100), DIGIT_COUNT] = 20,
    order: Literal["asc", "desc"] = "desc",
    after: Annotated[str | None, Query(max_length=200)] = None,
) -> dict[str, Any]:
    """The conversation that went into the response (earlier turns' inputs and outputs, then this turn's
    input; never ``instructions``), OpenAI's list shape, newest first unless ``order=asc``."""
    items = list((await _stored(gw, response_id, owner))["input_items"])
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    page = items[:limit]
    return {
        "object": "list", "data": page, "has_more": len(items) > limit,
        "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None,
    }  # fmt: skip
