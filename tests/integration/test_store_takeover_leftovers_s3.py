"""A takeover leaves under the version only what its manifest names, on a real S3 server (the session's
SeaweedFS): the cases of ``tests/unit/test_store_takeover_leftovers.py``, the replaced push's PutObject held
inside boto3 (``HeldPut`` of ``tests/integration/test_store_takeover_inflight_s3.py``)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from store.s3 import S3Backend
from tests.integration.test_store_takeover_inflight_s3 import BUCKET, HeldPut
from tests.unit.test_store_takeover_leftovers import leftovers_of_a_dead_push, race_extra_file_landing_mid_takeover
from tools.seaweed_server import EmbeddedSeaweed


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=2) as executor:
        yield executor


def _version() -> str:
    return f"1.0.0-{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize("takeover", [True, False], ids=["takeover-of-a-dead-push", "claim-removed-by-hand"])
def test_a_dead_push_leaves_nothing_under_the_published_version_on_s3(
    s3: EmbeddedSeaweed, tmp_path: Path, takeover: bool
) -> None:
    """Old code: the dead push's files under names the new manifest lacks stayed."""
    backend = S3Backend(BUCKET, endpoint_url=s3.endpoint_url, client=s3.client())
    leftovers_of_a_dead_push(backend, tmp_path, _version(), takeover=takeover, temp_name=None)


def test_a_file_the_replaced_push_lands_mid_takeover_is_removed_on_s3(
    s3: EmbeddedSeaweed, tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    """Old code: the replaced push's tokenizer_config.json stayed under the published version."""
    backend = S3Backend(BUCKET, endpoint_url=s3.endpoint_url, client=s3.client())
    race_extra_file_landing_mid_takeover(pool, backend, HeldPut(s3), tmp_path, _version())
