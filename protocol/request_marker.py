"""A request's submit marker (``fleet:req:<id>``): the JSON a producer writes when it queues a request, and a
worker writes again where Redis lost it (:mod:`workers.held_requests`).

The marker tells "queued" from "never heard of", names the request's model (the gateway's no-live-worker
warning) and output kind (``cancel`` stops a running generation only), and holds the body's fingerprint,
so a resubmit under the same ID with another body is refused (:mod:`producer.idempotent_queue`). Both
writers build it here, from the request alone, so the one a worker writes back is the producer's, byte
for byte.
"""

from __future__ import annotations

import hashlib
import json

from protocol.messages import InferenceRequest

__all__ = ["request_fingerprint", "request_marker"]


def request_fingerprint(request: InferenceRequest) -> str:
    """sha256 of what makes a request the same request (model, ids, output); not its ID or timestamps."""
    body = request.model_dump(mode="json", include={"model", "input_ids", "output", "truncated"})
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def request_marker(request: InferenceRequest, fingerprint: str | None = None) -> str:
    """The JSON kept under ``fleet:req:<id>`` while the request is known (read by status and streams);
    ``fingerprint``: :func:`request_fingerprint` of ``request``, computed when not given."""
    return json.dumps(
        {
            "model": request.model,
            "submitted_at_unix_s": request.submitted_at_unix_s,
            "kind": request.output.kind,
            "fingerprint": request_fingerprint(request) if fingerprint is None else fingerprint,
        }
    )
