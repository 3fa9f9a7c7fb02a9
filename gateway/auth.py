"""The API-key check, shared by the request guard (before any body is read) and the route dependency.

A key is accepted from either header: ``X-API-Key: <key>`` (the native API's) or
``Authorization: Bearer <key>`` (what the OpenAI SDKs send). With no keys configured, none is needed.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

__all__ = ["API_KEY_HEADER", "key_from_headers", "key_refusal"]

API_KEY_HEADER = "X-API-Key"


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
