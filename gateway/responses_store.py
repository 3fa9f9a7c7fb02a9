"""Stored Responses-API responses in Redis: one JSON document per response under
:data:`protocol.keys.RESPONSE_KEY` with TTL ``api.responses_ttl_s``, so every gateway process reads
what any other wrote and any of them continues a conversation.

A document holds:

* ``response``: the response object as ``POST``/``GET /v1/responses`` return it;
* ``history``: the conversation the next turn continues, as chat-template messages (``{"role",
  "content"}``): every earlier turn's input and output and this turn's, never ``instructions`` (each turn
  gives its own, as OpenAI does);
* ``input_items``: the input items of this response (the history before its output), as
  ``GET /v1/responses/{id}/input_items`` lists them.

The store is the whole state: a turn's cost in Redis is its history's text (a conversation of N turns
keeps N documents, each with the history so far, until each expires).
"""

from __future__ import annotations

import json
from typing import Any, TypedDict

import redis.asyncio

from protocol.errors import RequestNotFound
from protocol.keys import RESPONSE_KEY
from protocol.utf8 import mend_surrogates

__all__ = ["StoredResponse", "delete_response", "load_response", "not_found", "save_response"]


class StoredResponse(TypedDict):
    """One stored response (see the module docstring)."""

    response: dict[str, Any]
    history: list[dict[str, str]]
    input_items: list[dict[str, Any]]


def not_found(response_id: str, field: str | None = None) -> RequestNotFound:
    """OpenAI's 404 for a response that was never stored, was deleted, or expired."""
    return RequestNotFound(
        f"Response with id {response_id!r} not found (never stored, deleted, or older than api.responses_ttl_s)",
        field,
        None,
    )


async def save_response(aredis: redis.asyncio.Redis[bytes], doc: StoredResponse, ttl_s: int) -> None:
    """Write ``doc`` under its response's ID for ``ttl_s`` seconds.

    Raises:
        redis.RedisError: Redis did not take it.
    """
    key = RESPONSE_KEY.format(id=doc["response"]["id"])
    await aredis.set(key, json.dumps(doc, separators=(",", ":")), ex=ttl_s)


async def load_response(aredis: redis.asyncio.Redis[bytes], response_id: str) -> StoredResponse | None:
    """The stored response ``response_id``; None when there is none (never stored, deleted, expired).

    Raises:
        redis.RedisError: Redis did not answer.
    """
    raw = await aredis.get(RESPONSE_KEY.format(id=response_id))
    if raw is None:
        return None
    doc: StoredResponse = mend_surrogates(json.loads(raw))  # stored before the edge refused lone surrogates
    return doc


async def delete_response(aredis: redis.asyncio.Redis[bytes], response_id: str) -> bool:
    """Delete ``response_id``; False when there was none.

    Raises:
        redis.RedisError: Redis did not answer.
    """
    return bool(await aredis.delete(RESPONSE_KEY.format(id=response_id)))
