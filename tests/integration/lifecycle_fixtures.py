"""Helpers for the model-lifecycle tests: versions in a real S3 store, a load thread, worker watching."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from producer.client import FleetClient
from protocol.errors import FleetError
from protocol.keys import WORKER_KEY_PREFIX
from protocol.messages import InferenceRequest, InferenceResult
from tests.integration.conftest import s3_model_store
from tests.integration.fleet_fixtures import Fleet
from tests.integration.model_versions import MODEL, build_version, top1_logprob
from tools.seaweed_server import EmbeddedSeaweed

__all__ = [
    "Load", "Published", "Watch", "collect", "lifecycle_config", "publish", "send_to_role", "served_roles",
    "wait_until",
]

BUCKET = "fleet-models"


def wait_until(condition: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Poll ``condition`` every 50 ms until it returns something truthy; fails naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


@dataclass(frozen=True)
class Published:
    """A published version and the top-1 logprob its outputs carry."""

    version: str
    logprob: float


def publish(s3: EmbeddedSeaweed, tmp_path: Path, scale: float, *, fail_on_real_input: bool = False) -> Published:
    """Build an identity version with hot value ``scale`` and push it to the S3 store (unique version)."""
    version = f"1.0.0-{uuid.uuid4().hex[:8]}"
    onnx_file = build_version(tmp_path / "built", version, scale, fail_on_real_input=fail_on_real_input)
    store = s3_model_store(s3, tmp_path / "push-cache")
    store.push(onnx_file, MODEL, version)
    return Published(version, top1_logprob(scale))


def lifecycle_config(
    fleet: Fleet, s3: EmbeddedSeaweed, first: str, cache_dir: Path, worker: dict[str, Any] | None = None, **model: Any
) -> Path:
    """A config serving the identity model from the store at version ``first``; ``worker`` merges into
    the ``worker`` section, ``model`` into ``models.identity`` (e.g. ``canary={...}``)."""
    return fleet.config(
        store={"backend": "s3", "endpoint_url": s3.endpoint_url, "bucket": BUCKET, "cache_dir": str(cache_dir)},
        worker={"model": MODEL, "reconcile_interval_s": 2.0, **(worker or {})},
        models={MODEL: {"path": None, "store_version": first, "batching": {"max_batch_size": 8, "max_wait_ms": 2.0},
                        "limits": {"max_input_tokens": 64}, "engine": {"intra_op_threads": 1}, **model}},
    )


@dataclass
class Load:
    """A thread that submits requests all the time (about ``rate_per_s``) until stopped."""

    client: FleetClient
    rate_per_s: float = 60.0
    ids: list[str] = field(default_factory=list)
    refused: list[BaseException] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Load:
        self._thread = threading.Thread(target=self._run, name="load", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            try:
                self.ids.append(self.client.submit(MODEL, text=f"request {n} under load", top_k=1))
            except FleetError as exc:  # a refused submit is a failure the test reports
                self.refused.append(exc)
            self._stop.wait(1.0 / self.rate_per_s)

    def submitted_after(self, count: int, timeout_s: float = 60.0) -> None:
        """Wait until ``count`` more requests have been submitted."""
        target = len(self.ids) + count
        wait_until(lambda: len(self.ids) >= target, timeout_s, f"{count} more submitted requests")

    def stop(self) -> list[str]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        return list(self.ids)


def send_to_role(client: FleetClient, role: str, text: str) -> str:
    """Queue one request straight onto the model's ``role`` queue (stable or canary)."""
    request = InferenceRequest(model=MODEL, input_ids=client.tokenize(MODEL, text))
    return client.send(request, role=role)  # type: ignore[arg-type]


def collect(client: FleetClient, ids: list[str], timeout_s: float = 60.0) -> tuple[list[InferenceResult], list[str]]:
    """Every request's result (waiting up to ``timeout_s`` each); returns (results, failures as text)."""
    results: list[InferenceResult] = []
    failures: list[str] = []
    for rid in ids:
        try:
            res = client.result(rid, wait=True, timeout_s=timeout_s)
        except FleetError as exc:
            failures.append(f"{rid}: {type(exc).__name__}: {exc}")
            continue
        assert res is not None
        results.append(res)
    return results, failures


def served_roles(client: FleetClient, ids: list[str]) -> set[tuple[str, str | None]]:
    """(version, role) of each request's result; fails on any failure."""
    results, failures = collect(client, ids)
    assert not failures, failures
    return {(x.version, x.role) for x in results}


class Watch:
    """Records each worker's stable-version changes from its heartbeat: (version, since_unix_s)."""

    def __init__(self, redis_url: str, hostnames: list[str]) -> None:
        self.client = redis.Redis.from_url(redis_url)
        self.hostnames = hostnames
        self.changes: dict[str, list[tuple[str, float]]] = {h: [] for h in hostnames}
        self.docs: dict[str, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self.poll()
            except redis.RedisError:  # Redis restarting (a test restarts it): read again at the next turn
                continue

    def poll(self) -> None:
        for host in self.hostnames:
            raw = self.client.get(WORKER_KEY_PREFIX + host)
            if not raw:
                continue
            doc = json.loads(raw)
            self.docs[host] = doc
            entry = (str(doc["version"]), float(doc["version_since_unix_s"]))
            if not self.changes[host] or self.changes[host][-1] != entry:
                self.changes[host].append(entry)

    def all_serve(self, version: str, canary: str | None = None) -> bool:
        return all(
            self.docs.get(h, {}).get("version") == version and self.docs.get(h, {}).get("canary_version") == canary
            for h in self.hostnames
        )

    def version_at(self, host: str, unix_s: float) -> str | None:
        """The stable version ``host`` had in force at ``unix_s`` (from the recorded changes)."""
        current = None
        for version, since in self.changes[host]:
            if since <= unix_s:
                current = version
        return current

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.client.close()
