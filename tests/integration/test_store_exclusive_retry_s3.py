"""An exclusive PUT whose response is lost after the server applied it, retried by botocore (SeaweedFS).

The retry carries ``If-None-Match: *`` too and is refused (412) by the object its own first attempt wrote.
Before, that refusal read as another push's object: an upload stopped the push with "another push is still
writing", the claim's write with "being published by another push", the manifest's with "already published by a
concurrent push". Now a refused exclusive write or upload reads the object back (size, then sha256) and takes
our own bytes there as success; other bytes are still refused. The response is dropped by a ``before-send`` hook
on the client: it sends the request itself (the server stores the object), then raises ``ConnectionClosedError``
once for that key, which botocore's standard retry mode retries.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest
from boto3.s3.transfer import TransferConfig
from botocore.exceptions import ConnectionClosedError
from botocore.httpsession import URLLib3Session

import store.s3
from store import ModelStore, ObjectExists
from store.manifest import MANIFEST_NAME
from store.publish import CLAIM_NAME
from store.s3 import S3Backend
from tests.unit.test_store_takeover_fence import _check_published_intact, _folder
from tools.seaweed_server import EmbeddedSeaweed

BUCKET = "fleet-models"


class DropFirstResponse:
    """``before-send`` hook: the first landing request (PutObject, CompleteMultipartUpload) of each key in
    ``keys`` is sent here, applied by the server, and its response dropped (``ConnectionClosedError``)."""

    def __init__(self, keys: set[str]) -> None:
        self.pending = set(keys)
        self.dropped: list[tuple[str, int]] = []
        """(key, status the server answered) of each response dropped."""
        self.http = URLLib3Session()

    def __call__(self, request: Any, **_kwargs: Any) -> None:
        key = unquote(urlsplit(request.url).path).removeprefix(f"/{BUCKET}/")
        if key not in self.pending:
            return None
        self.pending.discard(key)
        answer = self.http.send(request)
        self.dropped.append((key, answer.status_code))
        raise ConnectionClosedError(endpoint_url=request.url)


def _backend(s3: EmbeddedSeaweed, keys: set[str]) -> tuple[S3Backend, DropFirstResponse]:
    client = s3.client(retries={"max_attempts": store.s3.RETRIES, "mode": "standard"})
    drop = DropFirstResponse(keys)
    for operation in ("PutObject", "CompleteMultipartUpload"):
        client.meta.events.register(f"before-send.s3.{operation}", drop)
    return S3Backend(BUCKET, endpoint_url=s3.endpoint_url, client=client), drop


@pytest.mark.parametrize("size_bytes", [1 << 10, 6 << 20], ids=["put", "multipart"])
def test_an_exclusive_upload_whose_response_was_lost_succeeds(
    s3: EmbeddedSeaweed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size_bytes: int
) -> None:
    """Old code: ObjectExists (the retry refused by the object the first attempt stored)."""
    monkeypatch.setattr(store.s3, "_TRANSFER", TransferConfig(multipart_threshold=5 << 20,
                                                              multipart_chunksize=5 << 20, max_concurrency=2))
    key = f"retry/{uuid.uuid4().hex}/blob.bin"
    backend, drop = _backend(s3, {key})
    source = tmp_path / "blob.bin"
    source.write_bytes(b"1" * size_bytes)
    assert backend.upload(key, source, exclusive=True) == size_bytes
    assert drop.dropped == [(key, 200)] and backend.read(key) == source.read_bytes()
    other = tmp_path / "other.bin"
    other.write_bytes(b"2" * size_bytes)  # same size, other bytes: still refused
    with pytest.raises(ObjectExists):
        backend.upload(key, other, exclusive=True)
    assert backend.read(key) == source.read_bytes()


def test_an_exclusive_write_whose_response_was_lost_succeeds(s3: EmbeddedSeaweed) -> None:
    """Old code: ObjectExists."""
    key = f"retry/{uuid.uuid4().hex}/claim.json"
    backend, drop = _backend(s3, {key})
    backend.write(key, b'{"token": "ours"}', exclusive=True)
    assert drop.dropped == [(key, 200)] and backend.read(key) == b'{"token": "ours"}'
    with pytest.raises(ObjectExists):
        backend.write(key, b'{"token": "else"}', exclusive=True)


@pytest.mark.parametrize("lost", ["tiny-1.0.0.onnx", CLAIM_NAME, MANIFEST_NAME])
def test_a_push_whose_put_response_was_lost_publishes(s3: EmbeddedSeaweed, tmp_path: Path, lost: str) -> None:
    """Old code: VersionExists (model file: "is still writing"; claim: "being published by another push";
    manifest: "already published by a concurrent push")."""
    version = f"1.0.0-{uuid.uuid4().hex[:8]}"
    backend, drop = _backend(s3, {f"tiny/{version}/{lost}"})
    path = _folder(tmp_path / "model", eos=2, weight_scale=1.0)
    store_ = ModelStore(backend, tmp_path / "cache")
    manifest = store_.push(path, "tiny", version)
    assert drop.dropped == [(f"tiny/{version}/{lost}", 200)]
    _check_published_intact(store_, backend, manifest, version)
