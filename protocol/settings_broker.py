"""How the fleet reaches Redis beyond ``redis_url`` (``redis``) and what Celery adds to each task (``celery``)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from protocol.settings_section import Section

__all__ = ["CelerySettings", "RedisSettings"]


class RedisSettings(Section):
    """How to reach Redis beyond ``redis_url``: TLS files and the Sentinel master (see
    :mod:`protocol.redis_conn`). Paths and names only: a password travels in ``FLEET_REDIS_URL``."""

    tls_ca_file: Path | None = Field(
        default=None, description="rediss://: CA bundle (PEM) the server's certificate is checked against."
    )
    tls_cert_file: Path | None = Field(default=None, description="rediss://: client certificate (PEM), if asked.")
    tls_key_file: Path | None = Field(default=None, description="rediss://: the client certificate's key (PEM).")
    sentinel_master: str | None = Field(
        default=None, description="sentinel://: the master name the sentinels monitor (required with one)."
    )


# -- Celery's per-task extras (dispatch cost; priced per request in docs/benchmarks.md) ------------
class CelerySettings(Section):
    """Celery's per-task extras: each costs Redis commands and CPU on every request (see the
    Dispatch cost section of ``docs/benchmarks.md``). The defaults keep Flower's live view."""

    task_events: bool = Field(
        default=True,
        description="The worker's task events (received, started, succeeded): what Flower shows. Gathered for "
        "`task_event_linger_ms` and published as one message; `fleet worker` also passes -E, which turns "
        "them on regardless.",
    )
    task_event_linger_ms: float = Field(
        default=20.0,
        ge=0,
        le=1000,
        description="How long (ms) a worker gathers its task events before publishing them as one task.multi "
        "message from a thread of its own, off the requests' path; Flower sees each event up to this much later, "
        "with the time it happened. 0 = one PUBLISH per event on the request's own thread (Celery's behaviour "
        "on the threads pool).",
    )
    sent_events: bool = Field(
        default=True,
        description="The producer's task-sent event (one PUBLISH per request): Flower lists a request while it "
        "waits in the queue and shows its queue (routing_key); without it, only from when a worker receives it.",
    )
    track_started: bool = Field(
        default=False,
        description="Store a STARTED state when any task starts (GET, SETEX + PUBLISH): RequestStatus RUNNING. "
        "Off, a worker stores it for generation requests only (they run long enough to be seen running, and "
        "cancel reads it); a one-step request goes from queued to its result.",
    )
    result_extended: bool = Field(
        default=False,
        description="Store the task's name, args, worker and queue beside its result (Celery's result_extended): "
        "nothing in the fleet reads them, and the args repeat the input ids in every stored result.",
    )
