"""Redis keys onnx-fleet writes beside Celery's own (``celery-task-meta-<id>``, queue lists)."""

from __future__ import annotations

__all__ = [
    "CANCEL_CHANNEL",
    "CANCEL_KEY",
    "CARD_KEY",
    "DEAD_LETTER_COUNTS_KEY",
    "DEAD_LETTER_KEY",
    "DELIVERIES_KEY",
    "DIRECT_QUEUES_KEY",
    "DRAIN_KEY",
    "LIVE_WORKERS_KEY",
    "OWNERS_HEADER",
    "OWNER_KEY",
    "PREFIX_HOLDER_KEY",
    "RATE_KEY",
    "REQUEST_ID_PATTERN",
    "REQUEST_ID_RULE",
    "REQUEST_KEY",
    "RESPONSE_KEY",
    "RESULT_KEY",
    "RUN_KEY",
    "STREAM_KEY",
    "TAKEN_KEY",
    "WORKER_KEY_PREFIX",
    "utf8_text",
]

REQUEST_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
"""Caller-given request IDs, on every face that takes one (client, CLI, gateway): they become Redis keys and
URL path segments (``GET /v1/requests/{id}``). IDs the fleet makes (uuid4 hex) match it."""
REQUEST_ID_RULE = "1 to 128 letters, digits and . _ : - (starting with a letter or digit)"
""":data:`REQUEST_ID_PATTERN` in words, for error messages."""
REQUEST_KEY = "fleet:req:{id}"
"""Written at submit (TTL = result_ttl_s): tells 'queued' from 'never heard of'."""
OWNER_KEY = "fleet:owner:{id}"
"""The owner of a request submitted through the gateway with auth on (a keyed digest of its API key,
:mod:`gateway.request_owners`); written before it is queued (TTL = result_ttl_s, renewed with the result's
TTL when the result is stored). A request without one is any accepted key's to read."""
OWNERS_HEADER = "fleet_owners"
"""The task message header that carries the owner marks of the requests it names (``{request_id: owner}``), so a
worker's result store writes a mark back where Redis lost it (:mod:`broker.result_backend`); no header, no owner."""
CANCEL_KEY = "fleet:cancel:{id}"
"""Written by cancel (TTL = result_ttl_s): a worker that dequeues the request drops it. Its value says which
cancel it was (:mod:`protocol.cancel_marks`): ``1``, for good (no worker held the request); ``held``, asked of
the worker that holds it (the request ends with whatever that worker stores)."""
TAKEN_KEY = "fleet:taken:{id}"
"""Written as a worker takes the request and finds no cancel mark (TTL = the visibility timeout): a cancel
after it is asked of that worker, not final (:mod:`protocol.cancel_marks`)."""
CANCEL_CHANNEL = "fleet:cancels"
"""Pub/sub channel: a cancel publishes the request ID here too, so a worker running that generation
stops it at its next step instead of at its next poll of the cancel marks."""
CARD_KEY = "fleet:model:{model}:card"
"""The model card JSON a worker publishes, for producers without the model file."""
LIVE_WORKERS_KEY = "fleet:live:{model}"
"""Sorted set: the hostnames of the workers serving ``model``, each scored by the wall-clock time (unix s)
its heartbeat expires; written with every heartbeat, so "has this model a live worker" is one ``ZCOUNT``
instead of a ``SCAN`` of the keyspace. A stopping worker removes itself."""
WORKER_KEY_PREFIX = "fleet:worker:"
"""+ hostname: a worker's heartbeat JSON, expiring after three heartbeat periods."""
DRAIN_KEY = "fleet:drain:{model}:{second}"
"""Requests workers took off the model's queue during one wall-clock second (integer unix time);
expires after the drain window. Admission sums them into the queue's drain rate."""
RATE_KEY = "fleet:rate:{key}"
"""A rate-limit token bucket (hash: tokens, ts) for one caller; ``key`` is a hash of the API key."""
STREAM_KEY = "fleet:stream:{id}"
"""A generation's token events (Redis Stream, TTL = result_ttl_s); see :mod:`protocol.streams`."""
DEAD_LETTER_KEY = "fleet:dead-letter"
"""Queue items a worker refused or gave up on (Redis list, newest first, capped): one JSON entry each,
see :mod:`protocol.deadletter`; ``fleet dead-letter`` lists, shows, requeues and purges them."""
DEAD_LETTER_COUNTS_KEY = "fleet:dead-letter:counts"
"""Queue items dead-lettered since the key was made, per reason (hash: reason -> count; never trimmed, unlike
:data:`DEAD_LETTER_KEY`, so a rate of dead letters can be read from it); ``fleet_dead_lettered_total``."""
DELIVERIES_KEY = "fleet:deliveries:{id}"
"""How many times the message with task ID ``id`` has been delivered to a worker (integer, TTL); written
from its first redelivery on, see :mod:`broker.deliveries`."""
RESPONSE_KEY = "fleet:response:{id}"
"""A stored Responses-API response (JSON: the response object, its conversation history and input items;
TTL = api.responses_ttl_s), so any gateway continues it with ``previous_response_id``."""
PREFIX_HOLDER_KEY = "fleet:prefix:{model}:{host}"
"""Set: the token-prefix block digests (16 bytes each, :mod:`protocol.prefix_digest`) whose KV the
worker ``host`` holds in its prefix cache; refreshed with every heartbeat, it expires ten heartbeat TTLs
(at least 60 s) after the last one. Read by prefix-aware routing (:mod:`producer.prefix_routing`), which
asks only live workers' sets."""
DIRECT_QUEUES_KEY = "fleet:direct:{model}"
"""Sorted set: the hostnames of the workers of ``model`` that consume a queue of their own
(``FleetSettings.direct_queue_for``), each scored by the wall-clock time (unix s) its heartbeat
expires. A worker past it is dead: any live worker moves its queue onto the model's queue
(:mod:`workers.direct_queue`); the entry stays until the dead worker's unacked requests, restored
into that queue after the visibility timeout, have been moved too. Each beat extends the key's life
to that long past the beat, so it goes once no worker beats."""


RESULT_KEY = "celery-task-meta-{id}"
"""Celery's Redis result key of a request (its task ID; the fleet sets no key prefix)."""
RUN_KEY = "fleet:run:{id}"
"""The worker process running the generation ``id`` (``"<instance> <hostname>"``), set when a delivery of
it starts and kept alive by that worker's heartbeat (TTL = three heartbeat periods): a second delivery of
the same ID waits instead of generating into the same stream (:mod:`workers.run_claims`)."""

def utf8_text(text: str) -> bool:
    """Whether ``text`` can be written as UTF-8, so as part of a Redis key (a request ID): JSON's
    ``\\ud800`` escape decodes to a lone surrogate, which cannot."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
