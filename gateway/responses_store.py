"""Stored Responses-API responses in Redis: one JSON document per response under
:data:`protocol.keys.RESPONSE_KEY` with TTL ``api.responses_ttl_s``, so every gateway process reads
what any other wrote and any of them continues a conversation.

A document holds:

* ``response``: the response object as ``POST``/``GET /v1/responses`` return it;
* ``history``: the conversation the next turn continues, as chat-template messages (``{"role",
  "content"}``): every earlier turn's input and output and this turn's, never ``instructions`` (each turn
  gives its own, as OpenAI does);
* ``input_items``: the input items of this response (the history before its output), as
  ``GET /v1/responses/{id}/input_items`` lists them;
* ``owner``: who may read, continue or delete it (:func:`gateway.auth.owner_of`: a keyed digest of the API
  key that created it, never the key; one shared owner while auth is off). Any other caller is told the
  response does not exist, in the words of an unknown ID (:func:`not_found`), so existence does not leak.
  It is written first in the JSON, so a reader compares it (constant time) before parsing the document: another
  owner's document is refused without being parsed, in about the time of an unknown ID.

While a stored turn runs, its ID holds a claim instead (:func:`claim_response`: the owner alone), so a turn that
names it as ``previous_response_id`` is told "still running" by its owner only; the answer replaces the claim,
and a turn that ends unstored (cancelled, failed) removes it (:func:`drop_claim`). A document stored before
owners were kept has none: it belongs to :data:`gateway.auth.OPEN_OWNER` (readable while auth is off only).

The store is the whole state: a turn's cost in Redis is its history's text (a conversation of N turns
keeps N documents, each with the history so far, until each expires).
"""

from __future__ import annotations

import json
from typing import Any, NotRequired, TypedDict

import redis.asyncio

from gateway.auth import OPEN_OWNER, same_owner
from protocol.errors import RequestNotFound
from protocol.keys import RESPONSE_KEY
from protocol.utf8 import mend_surrogates

__all__ = [
    "StoredResponse",
    "claim_response",
    "delete_response",
    "drop_claim",
    "load_response",
    "not_found",
    "save_response",
    "turn_claimed",
]


_OWNER_FIRST = b'{"owner":"'
"""How a document or claim written with its owner first begins (older documents: parsed, then compared)."""


class StoredResponse(TypedDict):
    """One stored response (see the module docstring)."""

    response: dict[str, Any]
    history: list[dict[str, str]]
    input_items: list[dict[str, Any]]
    owner: NotRequired[str]
    """Absent in documents stored before owners were kept: :data:`gateway.auth.OPEN_OWNER`'s."""


def not_found(response_id: str, field: str | None = None) -> RequestNotFound:
    """OpenAI's 404 for a response that was never stored, was deleted, expired, or is another key's."""
    return RequestNotFound(
        f"Response with id {response_id!r} not found (never stored, deleted, or older than api.responses_ttl_s)",
        field,
        None,
    )


async def save_response(aredis: redis.asyncio.Redis[bytes], doc: StoredResponse, ttl_s: int) -> None:
    """Write ``doc`` (with its ``owner``) under its response's ID for ``ttl_s`` seconds, replacing its claim.

    Raises:
        redis.RedisError: Redis did not take it.
    """
    key = RESPONSE_KEY.format(id=doc["response"]["id"])
    first = {"owner": doc.get("owner", OPEN_OWNER), **doc}  # read before the rest is parsed (_owned)
    await aredis.set(key, json.dumps(first, separators=(",", ":")), ex=ttl_s)


async def claim_response(aredis: redis.asyncio.Redis[bytes], response_id: str, owner: str, ttl_s: int) -> None:
    """Mark ``response_id`` as a turn of ``owner``'s still being made, for at most ``ttl_s`` seconds.

    Raises:
        redis.RedisError: Redis did not take it.
    """
    claim = {"owner": owner, "pending": True}
    await aredis.set(RESPONSE_KEY.format(id=response_id), json.dumps(claim, separators=(",", ":")), ex=ttl_s)


async def drop_claim(aredis: redis.asyncio.Redis[bytes], response_id: str) -> None:
    """Remove the claim of a turn that ended without storing its answer (only that turn's own call makes the
    claim or replaces it, so nothing else can be under its ID).

    Raises:
        redis.RedisError: Redis did not answer.
    """
    await aredis.delete(RESPONSE_KEY.format(id=response_id))


async def _owned(aredis: redis.asyncio.Redis[bytes], response_id: str, owner: str) -> dict[str, Any] | None:
    """The document or claim under ``response_id`` when ``owner`` owns it; None when there is none or it is
    another owner's (the same None: the caller cannot tell them apart)."""
    raw = await aredis.get(RESPONSE_KEY.format(id=response_id))
    if raw is None:
        return None
    if raw.startswith(_OWNER_FIRST):  # what save_response and claim_response write: no parse for another's
        end = raw.find(b'"', len(_OWNER_FIRST))
        if end < 0 or not same_owner(raw[len(_OWNER_FIRST) : end].decode(errors="replace"), owner):
            return None
    doc: dict[str, Any] = mend_surrogates(json.loads(raw))  # stored before the edge refused lone surrogates
    stored_owner = doc.get("owner", OPEN_OWNER)
    return doc if isinstance(stored_owner, str) and same_owner(stored_owner, owner) else None


async def load_response(aredis: redis.asyncio.Redis[bytes], response_id: str, owner: str) -> StoredResponse | None:
    """The stored response ``response_id`` when ``owner`` owns it; None when there is none (never stored,
    deleted, expired, still being made) or it is another owner's.

    Raises:
        redis.RedisError: Redis did not answer.
    """
    doc = await _owned(aredis, response_id, owner)
    if doc is None or doc.get("pending"):
        return None
    stored: StoredResponse = doc  # type: ignore[assignment]  # the shape save_response wrote
    return stored


async def turn_claimed(aredis: redis.asyncio.Redis[bytes], response_id: str, owner: str) -> bool:
    """Whether ``response_id`` is a turn of ``owner``'s still being made (claimed, not yet stored).

    Raises:
        redis.RedisError: Redis did not answer.
    """
    doc = await _owned(aredis, response_id, owner)
    return doc is not None and bool(doc.get("pending"))


async def delete_response(aredis: redis.asyncio.Redis[bytes], response_id: str, owner: str) -> bool:
    """Delete ``response_id`` when it is stored and ``owner``'s; False otherwise (none, still being made, or
    another owner's: nothing is deleted).

    Raises:
        redis.RedisError: Redis did not answer.
    """
    if await load_response(aredis, response_id, owner) is None:
        return False
    return bool(await aredis.delete(RESPONSE_KEY.format(id=response_id)))
