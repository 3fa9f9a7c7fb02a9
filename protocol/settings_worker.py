"""The ``worker`` section (what one worker process serves and how) and the ``log`` section its log lines
share with the gateway's."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from protocol.settings_section import Section

__all__ = ["LogSettings", "WorkerSettings"]


class WorkerSettings(Section):
    """What one worker process serves and how many requests it holds at once."""

    model: str = Field(default="demo-lm", description="The one model this process serves.")
    concurrency: int = Field(
        default=16,
        ge=1,
        le=4096,
        description="Token-bucket size C: requests held from dequeue to result write (threads).",
    )
    heartbeat_s: float = Field(default=2.0, gt=0, le=60, description="Registry heartbeat period (s).")
    loglevel: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    metrics_port: int = Field(default=0, ge=0, le=65535, description="Prometheus port; 0 = off.")
    max_deliveries: int = Field(
        default=3,
        ge=1,
        le=1000,
        description="Times one message may be delivered; a message back after that many deliveries without "
        "an ack (its worker died each time: segfault, OOM, os._exit) is dead-lettered, not run again (not a copy "
        "of a generation a live worker still runs: it waits for that outcome).",
    )
    reconcile_interval_s: float = Field(
        default=5.0,
        gt=0,
        le=3600,
        description="How often a worker re-reads its model's desired state (pinned / canary version) besides "
        "the pub/sub notice: pub/sub is instant but lossy across reconnects; the periodic read converges.",
    )
    allow_untested_kombu: bool = Field(
        default=False,
        description="Start even when celery or kombu is outside the versions the fleet was tested with "
        "(broker.TESTED; broker/ adapts their internals); logged as a warning at every start.",
    )
    metrics_host: str | None = Field(
        default=None,
        description="Address the metrics port binds; None = where the gateway binds (api.host, 127.0.0.1 by "
        "default). Set 0.0.0.0 where a scraper on another host must reach it (docker-compose does).",
    )
    stall_after_s: float = Field(
        default=120.0,
        gt=0,
        le=86_400,
        description="A worker that holds requests (or whose queue is non-empty) and completes, takes or "
        "computes nothing for this long reports not ready (heartbeat, fleet probe ready): it holds work it "
        "is not progressing (s).",
    )
    not_ready_after_failed_runs: int = Field(
        default=10,
        ge=1,
        le=1_000_000,
        description="A worker whose engine failed this many runs in a row (one-step batches, generation steps; "
        "none of their requests succeeded) reports not ready until a run succeeds again: it takes requests "
        "and fails them. Requests refused before the engine (invalid input, deadline passed, cancelled) do "
        "not count.",
    )
    slot_grace_s: float = Field(
        default=30.0,
        ge=0,
        le=86_400,
        description="A request held past its deadline (no deadline: past visibility_timeout_s) by more than "
        "this is reported as an overdue slot: a log line and fleet_worker_overdue_slots (s).",
    )
    stream_hold_events: int = Field(
        default=100_000,
        ge=1,
        le=10_000_000,
        description="Most token-stream events a worker holds while Redis does not answer (written, in order, "
        "when it does); past it tokens are dropped (fleet_worker_stream_events_dropped_total) and readers "
        "finish those streams from the stored results.",
    )
    stream_window_ms: float = Field(
        default=25.0,
        ge=0,
        le=1000,
        description="Token streams: the publisher waits this long after the first pending event before it "
        "writes, so each stream's tokens of several decode steps go out as one entry (fewer XADDs, less "
        "worker CPU; a token reaches readers up to this much later, a stream's first token never waits). "
        "0 = write at once (events that piled up during a write are coalesced anyway). docs/streaming.md.",
    )
    stream_hold_bytes: int = Field(
        default=32 * 1024 * 1024,
        ge=1024,
        le=4 * 1024**3,
        description="Most bytes of token-stream events a worker holds while Redis does not answer (see "
        "stream_hold_events).",
    )


class LogSettings(Section):
    """Log lines of the gateway and the workers (``fleet api``, ``celery -A workers.app worker``)."""

    format: Literal["text", "json"] = Field(
        default="text",
        description="'json': one JSON object per line (ts, level, logger, message), with request_id on the "
        "gateway's access lines and on worker lines that concern a request (FLEET_LOG__FORMAT=json).",
    )
