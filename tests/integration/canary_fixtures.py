"""Helpers for canary tests: two versions of demo-lm on the session's SeaweedFS, a worker-ready config."""

from __future__ import annotations

import time
from pathlib import Path

from producer.client import FleetClient
from protocol.messages import InferenceResult
from store import ModelStore
from tests.integration.conftest import s3_model_store
from tests.integration.fleet_fixtures import Fleet
from tests.integration.test_model_store import BUCKET, _version
from tools.seaweed_server import EmbeddedSeaweed

__all__ = ["MODEL", "publish_two_versions", "wait_canary_served"]

MODEL = "demo-lm"


def publish_two_versions(
    fleet: Fleet, s3: EmbeddedSeaweed, model_dir: Path, tmp_path: Path
) -> tuple[Path, ModelStore, str, str]:
    """Publish demo-lm twice (two fresh version names, the same bytes); returns a config whose
    workers serve the first from the store, the store, and both versions."""
    store = s3_model_store(s3, tmp_path / "push")
    v1, v2 = _version(), _version()
    for version in (v1, v2):
        store.push(model_dir / MODEL / f"{MODEL}-1.0.0.onnx", MODEL, version)
    cfg = fleet.config(
        store={"backend": "s3", "endpoint_url": s3.endpoint_url, "bucket": BUCKET, "cache_dir": str(tmp_path / "c")},
        models={MODEL: {"path": None, "store_version": v1}},
    )
    return cfg, store, v1, v2


def wait_canary_served(client: FleetClient, version: str, timeout_s: float = 90) -> None:
    """Until a request sent to the canary queue comes back computed by ``version``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rid = client.send(client.build_request(MODEL, [5, 6], top_k=1), role="canary")
        res = client.result(rid, wait=True, timeout_s=30)
        if isinstance(res, InferenceResult) and res.version == version:
            return
        time.sleep(0.2)  # the reconciler is still fetching / warming the canary
    raise AssertionError(f"no worker served canary {version} within {timeout_s} s")
