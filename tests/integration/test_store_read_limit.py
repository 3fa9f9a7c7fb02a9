"""An object the store reads whole (a manifest, a claim, a card's file) is refused past ``max_bytes`` with an error
that names the object, its size and the limit, on the local backend and a real S3 server (SeaweedFS); before, a
read had no limit, and a stray multi-GB object under a manifest's name went into the worker's memory."""

from __future__ import annotations

from pathlib import Path

import pytest

from store.backend import READ_LIMIT_BYTES, Backend
from store.errors import StoreError
from store.local import LocalBackend
from store.s3 import S3Backend
from tests.integration.lifecycle_fixtures import BUCKET
from tools.redis_server import free_port
from tools.seaweed_server import EmbeddedSeaweed


@pytest.fixture(params=["local", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "local":
        return LocalBackend(tmp_path / "store")
    s3: EmbeddedSeaweed = request.getfixturevalue("s3")
    return S3Backend(BUCKET, endpoint_url=s3.endpoint_url, client=s3.client())


def test_an_object_past_the_limit_is_refused_naming_it_its_size_and_the_limit(backend: Backend) -> None:
    backend.write("limit-test/1.0.0/manifest.json", b"x" * 2048)
    backend.write("limit-test/1.0.0/small.json", b"y" * 1024)
    with pytest.raises(StoreError) as info:
        backend.read("limit-test/1.0.0/manifest.json", max_bytes=1024)
    assert (info.value.field, info.value.limit) == ("max_bytes", 1024)
    assert "manifest.json is 2048 bytes" in info.value.message and "at most 1024 bytes" in info.value.message
    assert backend.read("limit-test/1.0.0/small.json", max_bytes=1024) == b"y" * 1024  # at the limit: read
    assert backend.read("limit-test/1.0.0/manifest.json", max_bytes=4096) == b"x" * 2048
    assert backend.read("limit-test/1.0.0/absent.json", max_bytes=1024) is None
    assert READ_LIMIT_BYTES == 64 * 1024 * 1024  # the default: a tokenizer's JSON fits, a model file does not


def test_a_failure_on_the_stores_root_names_the_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """A listing of every model (key ``""``) that fails named an empty field (``fleet models list``: ``"field":
    ""``); it names the store itself."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test-key-id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test-secret")
    backend = S3Backend(BUCKET, endpoint_url=f"http://127.0.0.1:{free_port()}")  # nothing listens there
    with pytest.raises(StoreError) as info:
        backend.children("")
    assert info.value.field == "store", info.value.to_payload()
