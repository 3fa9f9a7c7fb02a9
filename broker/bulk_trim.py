"""A ``fleet.infer_bulk`` queue item without some of its requests: what a dead-letter requeue puts back when
another requeue already put some of its request IDs back (or they have an outcome stored).

The item keeps everything else byte for byte in meaning: its envelope, headers, task ID and the body's
encoding (base64 or text); only ``args[0].requests`` loses the items whose ``request_id`` is dropped, and the
``argsrepr`` header is rewritten to count the requests left (:func:`broker.queue_weight.bulk_argsrepr`: the
queue's weight reads it).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Collection
from typing import Any

from kombu.utils.json import dumps as _kombu_dumps

from broker.message_fields import body_bytes, kombu_loads
from broker.queue_weight import bulk_argsrepr
from protocol.errors import DecodeError
from protocol.messages import BULK_TASK_NAME

__all__ = ["bulk_item_without"]


def bulk_item_without(item: bytes, drop: Collection[str]) -> bytes:
    """``item`` (a ``fleet.infer_bulk`` kombu envelope as the list holds it) without the requests whose
    ``request_id`` is in ``drop``; ``item`` itself when ``drop`` names none of them.

    Raises:
        DecodeError: ``item`` is not a readable ``fleet.infer_bulk`` message (field: the part that broke).
    """
    try:
        doc = json.loads(item)
        if not isinstance(doc, dict) or not isinstance(doc.get("headers"), dict):
            raise DecodeError("not a kombu envelope", "headers", None)
        if doc["headers"].get("task") != BULK_TASK_NAME:
            raise DecodeError(f"not a {BULK_TASK_NAME} message", "headers.task", BULK_TASK_NAME)
        body = kombu_loads(body_bytes(doc))
        requests = body[0][0]["requests"]
    except DecodeError:
        raise
    except Exception as exc:  # any malformed part: the requeue is refused, nothing changes
        raise DecodeError(f"the {BULK_TASK_NAME} message cannot be read to drop requests from it: {exc}",
                          "body", None) from exc  # fmt: skip
    if not isinstance(requests, list):
        raise DecodeError("args[0].requests is not a list", "body[0][0].requests", None)
    kept = [r for r in requests if not (isinstance(r, dict) and r.get("request_id") in drop)]
    if len(kept) == len(requests):
        return item
    body[0][0] = {**body[0][0], "requests": kept}
    encoded: Any = _kombu_dumps(body)  # type: ignore[no-untyped-call]
    text = encoded if isinstance(encoded, str) else encoded.decode("utf-8")
    if doc["properties"].get("body_encoding") == "base64":
        doc["body"] = base64.b64encode(text.encode("utf-8")).decode("ascii")
    else:
        doc["body"] = text
    if "argsrepr" in doc["headers"]:
        doc["headers"]["argsrepr"] = bulk_argsrepr([r for r in kept if isinstance(r, dict)])
    return json.dumps(doc).encode("utf-8")
