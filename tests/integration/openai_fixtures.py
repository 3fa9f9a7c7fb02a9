"""One served fleet for the OpenAI-route tests: a real ``fleet api`` process, a demo-lm worker, a
demo-encoder worker and real Redis, plus ``plain-lm`` (the demo LM's file without a chat template,
no worker) for the refusals that never reach a worker.

Import what you use into a test module (``from tests.integration.openai_fixtures import served,
ops_models, ops_redis``); the fleet lives for one module and each test reads its own request IDs.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from tests.integration.ops_fixtures import API_KEY, GatewayProcess, OpsFleet, ops_models, ops_redis, wait_until
from tools.redis_server import EmbeddedRedis

__all__ = ["API_KEY", "Served", "ops_models", "ops_redis", "served", "stored_meta"]


@dataclass
class Served:
    fleet: OpsFleet
    gateway: GatewayProcess
    http: httpx.Client
    redis: redis.Redis[bytes]

    @property
    def base_url(self) -> str:
        """What the OpenAI SDKs take as ``base_url``."""
        return self.gateway.url + "/v1"

    def finished(self, rid: str, timeout_s: float = 60) -> dict[str, Any]:
        """``GET /v1/requests/{rid}`` once the request has finished."""

        def done() -> dict[str, Any] | None:
            doc: dict[str, Any] = self.http.get(f"/v1/requests/{rid}").json()
            return doc if doc["status"] not in ("queued", "running") else None

        result: dict[str, Any] = wait_until(done, timeout_s, f"request {rid} to finish")
        return result


def _plain_copy(lm: Path, root: Path) -> Path:
    """The demo LM's model file and card alone, in a folder without tokenizer_config.json."""
    folder = root / "plain-lm"
    folder.mkdir()
    for source in (lm, lm.with_suffix(".json")):
        shutil.copy(source, folder / source.name)
    return folder / lm.name


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, ops_models: Any, ops_redis: EmbeddedRedis) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("openai")
    fleet = OpsFleet(root, ops_models, ops_redis)
    try:
        plain = _plain_copy(ops_models.lm, root)
        config = fleet.config(
            models={"plain-lm": {"path": str(plain), "limits": {"max_input_tokens": 64}}},
            api={"max_body_bytes": 65_536},
        )
        fleet.worker(config, "demo-lm")
        fleet.worker(config, "demo-encoder")
        gateway = fleet.gateway(config)
        with httpx.Client(base_url=gateway.url, headers={"X-API-Key": API_KEY}, timeout=30) as http:
            yield Served(fleet, gateway, http, fleet.redis)
    finally:
        fleet.close()


def stored_meta(served: Served, rid: str) -> bytes | None:
    """The raw Celery result of ``rid`` (None while it has none)."""
    raw: bytes | None = served.redis.get(f"celery-task-meta-{rid}")
    return raw
