"""What Flower shows of a request: JSON ``argsrepr`` (Celery's display string for a task's args).

Celery shows a task's args with Python's ``repr`` unless the sender gives ``argsrepr``; Flower then
shows that string. The fleet sends the request as JSON, with the text it was tokenized from (when
it had one) beside its token ids, long id lists shortened so the row stays readable.
"""

from __future__ import annotations

import json
from typing import Any

from protocol.messages import InferenceRequest

__all__ = ["MAX_SHOWN_IDS", "MAX_SHOWN_TEXT", "request_argsrepr"]

MAX_SHOWN_IDS = 32
"""Token ids shown in full; a longer list shows its first ids and its length."""
MAX_SHOWN_TEXT = 500
"""Characters of text shown."""


def request_argsrepr(request: InferenceRequest, text: str | None = None) -> str:
    """The JSON string Flower shows as the task's args: ``[request]`` with ``text`` added."""
    doc: dict[str, Any] = request.model_dump(mode="json", exclude_none=True)
    ids = doc["input_ids"]
    if len(ids) > MAX_SHOWN_IDS:
        doc["input_ids"] = ids[:MAX_SHOWN_IDS]
        doc["input_ids_shown"] = f"{MAX_SHOWN_IDS} of {len(ids)}"
    if text is not None:
        doc["text"] = text if len(text) <= MAX_SHOWN_TEXT else text[:MAX_SHOWN_TEXT] + "…"
    return json.dumps([doc], ensure_ascii=False)
