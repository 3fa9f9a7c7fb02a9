"""What a request must pass before its body is parsed: the API key, the Content-Type, the JSON's shape.

Memory must be bounded by the body cap, not by what the body expands into. A 800 kB body of
``[[5],[5],…]`` is 200,000 lists once parsed (about 20 MB of Python objects, more again while
pydantic tries each member of a union), so 16 such calls took a gateway past 1 GB while every one
of them was refused. Two plain-ASGI middlewares stand in front of the routes:

* :class:`RequestGuardMiddleware` (before the body is read): every ``/v1/*`` request needs an
  accepted API key (401), and a body sent to ``/v1/*`` must be declared JSON (415 names
  ``Content-Type``; no route reads forms, so curl's ``-d`` default, a form type, is refused too).
* :class:`JsonShapeMiddleware` (after the body cap, before parsing): :func:`scan_json` walks the
  raw bytes without building anything and refuses (413, naming the top-level field and the limit)
  a body nested deeper than :data:`MAX_JSON_DEPTH` or holding more arrays/objects or strings than
  :class:`BodyBounds` allows. Numbers are not counted: a list of token ids parses to at most ~5
  bytes of Python per byte of JSON, and the routes check its length against the model's limits.
  Then :func:`duplicate_key_path` refuses (400, naming the key's path, e.g. ``messages[0].role``) an
  object that holds one key twice, at any depth: Python keeps the last, while a proxy or WAF in front
  that keeps the first would have judged another request. It parses the body as the route will
  (``json.loads`` of the bytes, one ``object_pairs_hook`` call per object: linear in the body), so
  the two cannot disagree on what a key is (escapes such as ``"\u0061"`` for ``"a"`` included).

Both answer in the route's error shape (OpenAI's on the OpenAI routes, :mod:`gateway.errors`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.auth import API_KEY_HEADER, key_from_headers, key_refusal
from gateway.errors import error_payload, is_openai_path, is_v1_path, openai_error
from protocol.settings import FleetSettings

__all__ = [
    "MAX_JSON_DEPTH",
    "BodyBounds",
    "JsonShapeMiddleware",
    "RequestGuardMiddleware",
    "ShapeRefusal",
    "bounds_for",
    "duplicate_key_path",
    "has_body",
    "replaying",
    "scan_json",
    "send_error",
]

MAX_JSON_DEPTH = 32
"""Deepest nesting of arrays/objects a body may have (the deepest body the fleet reads nests 6)."""
CONTAINERS_PER_ITEM = 16
"""Arrays/objects allowed per batch item or input (a native request with its output, generation,
stop lists nests at most 6)."""
STRINGS_PER_ITEM = 64
"""Strings allowed per batch item or input (object keys are strings: a native request has ~20)."""
BASE_ALLOWANCE = 256
"""Arrays/objects allowed on top of the per-item allowance (strings: four times this)."""
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_UNREAD = {"Connection": "close"}  # the body was not read: the connection cannot carry another request
_CURL_DEFAULT = "application/x-www-form-urlencoded"
"""What ``curl -d`` sends without ``-H 'Content-Type: …'``: the most common way to send JSON undeclared."""
# a JSON string (escapes included), optionally followed by ':' (then it is a key), or a bracket
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"\s*(:?)|[\[\]{}]')


@dataclass(frozen=True)
class BodyBounds:
    """How much structure one JSON body may hold, whatever its size in bytes."""

    max_depth: int
    max_containers: int
    max_strings: int
    per_item_note: str
    """Says where the counts come from, for the refusal's message."""


def bounds_for(settings: FleetSettings) -> BodyBounds:
    """Bounds that fit the largest legitimate body: ``api.max_batch_requests`` items, each with room to spare."""
    items = settings.api.max_batch_requests
    note = f"api.max_batch_requests={items}"
    return BodyBounds(
        max_depth=MAX_JSON_DEPTH,
        max_containers=CONTAINERS_PER_ITEM * items + BASE_ALLOWANCE,
        max_strings=STRINGS_PER_ITEM * items + 4 * BASE_ALLOWANCE,
        per_item_note=note,
    )


@dataclass(frozen=True)
class ShapeRefusal:
    """Why a body was refused: what was exceeded, the limit, and the top-level field where it happened."""

    what: str
    limit: int
    field: str | None

    def message(self, bounds: BodyBounds) -> str:
        where = f"in field {self.field!r}" if self.field else "in the body"
        if self.what == "depth":
            return f"request body nests arrays/objects deeper than {self.limit} levels {where}"
        per_item = CONTAINERS_PER_ITEM if self.what == "arrays/objects" else STRINGS_PER_ITEM
        return (
            f"request body holds more than {self.limit} JSON {self.what} ({where}); the limit is "
            f"{per_item} per item of {bounds.per_item_note}: send at most that many inputs or requests per call"
        )


def scan_json(body: bytes, bounds: BodyBounds) -> ShapeRefusal | None:
    """Walk ``body``'s strings and brackets (never building objects) and say which bound it breaks, if any.

    Stops at the first bound crossed, so the walk costs at most ``max_containers + max_strings``
    steps in Python; the bytes between tokens (numbers, ``true``, spaces) are skipped by the regex
    engine. Invalid JSON is not judged here (the parser that runs next reports it).
    """
    depth = containers = strings = 0
    key: str | None = None
    for match in _TOKEN.finditer(body):
        first = body[match.start()]
        if first == 0x22:  # '"'
            strings += 1
            if strings > bounds.max_strings:
                return ShapeRefusal("strings", bounds.max_strings, key)
            if depth == 1 and match.group(1):  # a key of the top-level object
                key = _key_text(body[match.start() : match.end()])
        elif first in b"[{":
            depth += 1
            containers += 1
            if depth > bounds.max_depth:
                return ShapeRefusal("depth", bounds.max_depth, key)
            if containers > bounds.max_containers:
                return ShapeRefusal("arrays/objects", bounds.max_containers, key)
        else:
            depth -= 1
    return None


def _key_text(token: bytes) -> str:
    raw = token.rstrip().rstrip(b":").rstrip()
    try:
        text = json.loads(raw)
    except ValueError:
        text = raw.decode("utf-8", "replace")
    return str(text)[:100]


class _Repeated(dict[str, Any]):
    """An object that held ``key`` more than once (its value: the last, as ``json.loads`` keeps)."""

    key: str


def _object(pairs: list[tuple[str, Any]], seen: list[bool]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) == len(pairs):
        return obj
    repeated = _Repeated(obj)
    keys: set[str] = set()
    for key, _ in pairs:
        if key in keys:
            repeated.key = key
            break
        keys.add(key)
    seen.append(True)
    return repeated


def duplicate_key_path(body: bytes) -> str | None:
    """The path of a key that an object of JSON ``body`` holds twice (the outermost such object's, the
    earliest in the document among equals; in it, the first key seen again), e.g.
    ``messages[0].role`` (``[2].model`` in a top-level array; each key cut to 100 characters); None when
    there is none, or when ``body`` is not JSON (the route's parser reports that).

    Cost: one parse plus one call per object; the walk for the path runs only when a key repeats.
    """
    seen: list[bool] = []
    try:
        doc = json.loads(body, object_pairs_hook=lambda pairs: _object(pairs, seen))
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or an integer past Python's digit cap
        return None
    if not seen:
        return None
    stack: list[tuple[Any, str]] = [(doc, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, _Repeated):
            return _joined(path, node.key)
        if isinstance(node, dict):
            stack.extend((value, _joined(path, key)) for key, value in reversed(node.items()))
        elif isinstance(node, list):
            stack.extend((value, f"{path}[{i}]") for i, value in reversed(list(enumerate(node))))
    return None  # unreachable: a repeat was seen, so a _Repeated is in the tree


def _joined(path: str, key: str) -> str:
    return f"{path}.{key[:100]}" if path else key[:100]


def replaying(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the app the body a middleware already read, whole, then the rest of the
    connection's messages (a disconnect) from ``receive``."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def send_error(
    scope: Scope, send: Send, status: int, payload: dict[str, Any], headers: dict[str, str] | None = None
) -> None:
    """Answer ``payload`` (a native error) with ``status``, in OpenAI's shape on the OpenAI routes."""
    if is_openai_path(str(scope.get("path", ""))):
        payload = openai_error(status, payload)
    raw = json.dumps(payload).encode()
    extra = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(raw)).encode()),
                *extra,
            ],
        }
    )
    await send({"type": "http.response.body", "body": raw})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers") or []:
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


def has_body(scope: Scope) -> bool:
    """Whether the request declares a body (a non-zero ``Content-Length``, or a ``Transfer-Encoding``): without
    either, an HTTP/1.1 request has none (RFC 9112, section 6.3)."""
    length = _header(scope, b"content-length")
    return (length is not None and length.strip() != "0") or _header(scope, b"transfer-encoding") is not None


def _is_json(content_type: str) -> bool:
    media = content_type.partition(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def repeated_query_parameter(query: bytes) -> str | None:
    """The first parameter name ``query`` (a raw query string) gives twice, decoded as the routes decode it
    (``?wait_s=1&wait%5Fs=600`` repeats ``wait_s``); None when each is given once."""
    seen: set[str] = set()
    for name, _ in parse_qsl(query.decode("latin-1"), keep_blank_values=True):
        if name in seen:
            return name[:100]
        seen.add(name)
    return None


def doubled_credentials(scope: Scope) -> str | None:
    """Why the request's credentials are ambiguous (None when they are not): ``X-API-Key`` or ``Authorization``
    given more than once, or both given with different keys. The gateway took the first header and
    ``X-API-Key`` over ``Authorization``; a proxy in front that checks another one (the last, or the bearer)
    would let a request through on one key that the gateway then serves, and stores for, under the other."""
    names = (API_KEY_HEADER.lower().encode(), b"authorization")
    seen: dict[bytes, list[str]] = {name: [] for name in names}
    for key, value in scope.get("headers") or []:
        if key.lower() in seen:
            seen[key.lower()].append(bytes(value).decode("latin-1"))
    for name, values in seen.items():
        if len(values) > 1:
            shown = API_KEY_HEADER if name == names[0] else "Authorization"
            return f"header {shown} is given {len(values)} times: send the credentials once"
    api_key, authorization = seen[names[0]], seen[names[1]]
    bearer = key_from_headers(None, authorization[0]) if authorization else None
    if api_key and bearer is not None and bearer != api_key[0]:
        return f"headers {API_KEY_HEADER} and Authorization name different keys: send one of them"
    return None


class RequestGuardMiddleware:
    """Refuse a ``/v1/*`` request with its credentials given twice or two different ways (400), without an
    accepted key (401), with a query parameter given twice (400), or
    with a body not declared JSON (415), before a byte of its body is read."""

    def __init__(self, app: ASGIApp, keys: list[bytes]) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_v1_path(str(scope.get("path", ""))):
            await self.app(scope, receive, send)
            return
        doubled = doubled_credentials(scope)
        if doubled is not None:  # refused before any key is judged: which one a proxy checks may differ
            await send_error(scope, send, 400, error_payload("duplicate_credentials", "DuplicateKey", doubled,
                                                             "headers", 1), _UNREAD)  # fmt: skip
            return
        key = key_from_headers(_header(scope, API_KEY_HEADER.lower().encode()), _header(scope, b"authorization"))
        refusal = key_refusal(key, self.keys)
        if refusal:
            payload = error_payload("unauthorized", "HTTPError", refusal)
            await send_error(scope, send, 401, payload, {"WWW-Authenticate": "Bearer", **_UNREAD})
            return
        repeated = repeated_query_parameter(scope.get("query_string", b""))
        if repeated is not None:
            msg = (f"query parameter {repeated!r} is given more than once: each may appear once (which one a reader "
                   "keeps differs between parsers)")  # fmt: skip
            await send_error(scope, send, 400, error_payload("duplicate_query_parameter", "DuplicateKey", msg,
                                                             repeated, 1), _UNREAD)  # fmt: skip
            return
        if scope.get("method") in _BODY_METHODS and has_body(scope):
            content_type = _header(scope, b"content-type")
            if content_type is None or not _is_json(content_type):
                said = "is missing" if content_type is None else f"is {content_type!r}"
                msg = f"Content-Type {said}: the body must be JSON, sent with header 'Content-Type: application/json'"
                if content_type is not None and content_type.startswith(_CURL_DEFAULT):
                    msg += " (curl -d sends a form type unless -H 'Content-Type: application/json' is given)"
                payload = error_payload("unsupported_media_type", "UnsupportedMediaType", msg, "Content-Type",
                                        "application/json")  # fmt: skip
                await send_error(scope, send, 415, payload, _UNREAD)
                return
        await self.app(scope, receive, send)


class JsonShapeMiddleware:
    """Refuse (413) a JSON body to ``/v1/*`` whose structure breaks :class:`BodyBounds`, before it is parsed,
    and (400) one whose objects repeat a key (:func:`duplicate_key_path`).

    Sits inside the body cap (:class:`gateway.middleware.BodyLimitMiddleware`), so the body it
    gathers is at most ``api.max_body_bytes``; it hands the same bytes on to the route.
    """

    def __init__(self, app: ASGIApp, bounds: BodyBounds) -> None:
        self.app = app
        self.bounds = bounds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        content_type = _header(scope, b"content-type") or ""
        if (
            scope["type"] != "http"
            or scope.get("method") not in _BODY_METHODS
            or not is_v1_path(str(scope.get("path", "")))
            or not _is_json(content_type)
        ):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        del chunks
        refusal = scan_json(body, self.bounds)
        if refusal is not None:
            field = refusal.field or "body"
            payload = error_payload("body_too_complex", "PayloadTooLarge", refusal.message(self.bounds), field,
                                    refusal.limit)  # fmt: skip
            await send_error(scope, send, 413, payload)
            return
        repeated = duplicate_key_path(body)
        if repeated is not None:
            msg = (f"request body repeats key {repeated!r}: each key may appear once per object (which one a "
                   "reader keeps differs between parsers)")  # fmt: skip
            await send_error(scope, send, 400, error_payload("duplicate_key", "DuplicateKey", msg, repeated, 1))
            return
        await self.app(scope, replaying(body, receive), send)
