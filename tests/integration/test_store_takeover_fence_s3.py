"""``fleet models push --takeover`` of a push still running, against a real S3 server (the session's
SeaweedFS, as ``test_model_store.py``): the interleaving of ``tests/unit/test_store_takeover_fence.py``
in which the taken-over push would write its manifest over files the takeover had begun to upload."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from store.s3 import S3Backend
from tests.unit.test_store_takeover_fence import race_at_commit
from tools.seaweed_server import EmbeddedSeaweed

BUCKET = "fleet-models"


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=2) as executor:
        yield executor


def test_a_taken_over_push_never_writes_its_manifest_on_s3(
    s3: EmbeddedSeaweed, tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    """Before the fence: A's manifest was published over B's first file (every fetch: ChecksumMismatch)."""
    backend = S3Backend(BUCKET, endpoint_url=s3.endpoint_url, client=s3.client())
    race_at_commit(pool, backend, tmp_path, f"1.0.0-{uuid.uuid4().hex[:8]}")
