"""The API-key check, shared by the request guard (before any body is read) and the route dependency.

A key is accepted from either header: ``X-API-Key: <key>`` (the native API's) or
``Authorization: Bearer <key>`` (what the OpenAI SDKs send). With no keys configured, none is needed.

:func:`owner_of` names who owns what a caller stores (a ``/v1/responses`` response): a keyed digest of the
key, never the key itself, so Redis never holds a key in clear.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

__all__ = ["API_KEY_HEADER", "OPEN_OWNER", "key_from_headers", "key_refusal", "owner_of", "same_owner"]

API_KEY_HEADER = "X-API-Key"
OPEN_OWNER = "open"
"""The one owner of everything stored while no key is configured (auth off): every caller."""
_OWNER_LABEL = b"onnx-fleet owner v1"
"""What :func:`owner_of` signs with the key: a digest made for owners is no rate-bucket name or other digest."""


def key_from_headers(api_key: str | None, authorization: str | None) -> str | None:
    """The key the caller presented: ``X-API-Key`` first, else the credentials of ``Authorization: Bearer``."""
    if api_key:
        return api_key
    scheme, _, credentials = (authorization or "").partition(" ")
    return credentials.strip() or None if scheme.lower() == "bearer" else None


def key_refusal(key: str | None, keys: Sequence[bytes]) -> str | None:
    """Why ``key`` is refused (a message for the 401), or None when it is accepted.

    ``keys`` are the configured keys, encoded; empty means no key is needed. Compared in constant time.
    """
    if not keys or (key and any(hmac.compare_digest(key.encode(), k) for k in keys)):
        return None
    return (
        f"{'wrong' if key else 'missing'} API key: send header {API_KEY_HEADER} or "
        "'Authorization: Bearer <key>' with one of the keys in api.api_keys"
    )


def owner_of(key: str | None, keys: Sequence[bytes]) -> str:
    """Who owns what a caller presenting ``key`` stores: HMAC-SHA256 keyed with the API key over a fixed label
    (hex, 64 characters), or :data:`OPEN_OWNER` when ``keys`` is empty (auth off: one shared owner, whatever
    key a caller sends). Call it for an accepted key only (:func:`key_refusal` returned None)."""
    if not keys or not key:
        return OPEN_OWNER
    return hmac.new(key.encode(), _OWNER_LABEL, hashlib.sha256).hexdigest()


def same_owner(stored: str, caller: str) -> bool:
    """Whether ``caller`` (an :func:`owner_of`) owns what ``stored`` names; compared in constant time."""
    return hmac.compare_digest(stored.encode(), caller.encode())
