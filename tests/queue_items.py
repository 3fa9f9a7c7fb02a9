"""Raw queue items for the poison tests: kombu envelopes built by hand, the way `LPUSH` sees them.

A Celery client's message on the Redis broker is one JSON envelope per list item::

    {"body": base64(json([args, kwargs, embed])), "content-type": "application/json",
     "content-encoding": "utf-8", "headers": {"task": ..., "id": ..., ...},
     "properties": {"delivery_tag": ..., "delivery_info": {"exchange": "", "routing_key": queue},
                    "body_encoding": "base64", "priority": 0, ...}}

:func:`envelope` builds one with every part replaceable, so a test can break exactly one of them.
"""

from __future__ import annotations

import base64
import json
import pickle
import uuid
from typing import Any

__all__ = ["celery_headers", "envelope", "good_body", "pickle_item", "raw"]

EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


def celery_headers(task: str, task_id: str) -> dict[str, Any]:
    """Protocol 2 headers as ``celery.app.amqp.as_task_v2`` writes them."""
    return {
        "lang": "py", "task": task, "id": task_id, "shadow": None, "eta": None, "expires": None,
        "group": None, "group_index": None, "retries": 0, "timelimit": [None, None],
        "root_id": task_id, "parent_id": None, "argsrepr": "(...)", "kwargsrepr": "{}",
        "origin": "test@localhost", "ignore_result": None, "replaced_task_nesting": 0,
        "stamped_headers": None, "stamps": {},
    }


def good_body(request: dict[str, Any]) -> bytes:
    """The JSON body of ``fleet.infer`` carrying ``request``: ``[[request], {}, embed]``."""
    return json.dumps([[request], {}, EMBED]).encode()


def envelope(
    queue: str,
    body: bytes | str | Any,
    *,
    task: str = "fleet.infer",
    task_id: str | None = None,
    headers: Any = None,
    content_type: Any = "application/json",
    content_encoding: Any = "utf-8",
    properties: Any = None,
    body_encoding: Any = "base64",
) -> dict[str, Any]:
    """A kombu envelope for ``queue``; ``body`` bytes are base64-encoded unless ``body_encoding`` is not base64."""
    task_id = task_id or uuid.uuid4().hex
    if isinstance(body, bytes) and body_encoding == "base64":
        body = base64.b64encode(body).decode()
    elif isinstance(body, bytes):
        body = body.decode("utf-8", "surrogateescape")
    props = properties if properties is not None else {
        "correlation_id": task_id, "reply_to": "", "delivery_mode": 2,
        "delivery_info": {"exchange": "", "routing_key": queue}, "priority": 0,
        "body_encoding": body_encoding, "delivery_tag": uuid.uuid4().hex,
    }
    return {
        "body": body,
        "content-type": content_type,
        "content-encoding": content_encoding,
        "headers": headers if headers is not None else celery_headers(task, task_id),
        "properties": props,
    }


def raw(item: dict[str, Any]) -> bytes:
    """The list item's bytes."""
    return json.dumps(item).encode()


def pickle_item(queue: str, request: dict[str, Any], task_id: str) -> bytes:
    """A pickle-serialized ``fleet.infer`` message (what ``send_task(..., serializer="pickle")`` sends)."""
    body = pickle.dumps(((request,), {}, EMBED), protocol=2)
    return raw(envelope(queue, body, task_id=task_id, content_type="application/x-python-serialize",
                        content_encoding="binary"))


def shared_tag_generations(queue: str, ids: list[str], *, tag: str = "one-tag-for-all",
                           new_tokens: int = 480) -> list[bytes]:  # fmt: skip
    """Queue items for generations of ``new_tokens`` (``ignore_eos``) under task IDs ``ids``, all carrying one
    delivery ``tag``: what a sender that reuses tags queues (``LPUSH`` them in order)."""
    request = {"model": "demo-lm", "input_ids": [5, 6, 7],
               "output": {"kind": "generate", "generation": {"max_new_tokens": new_tokens, "ignore_eos": True}}}
    items = []
    for rid in ids:
        item = envelope(queue, good_body(request), task_id=rid)
        item["properties"]["delivery_tag"] = tag
        items.append(raw(item))
    return items
