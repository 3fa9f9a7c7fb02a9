"""``fleet models push --takeover`` with an upload of the replaced push in flight, against a real S3 server
(the session's SeaweedFS): the interleavings of ``tests/unit/test_store_takeover_inflight.py``, push A's
PutObject held inside boto3 (a ``before-send`` hook on A's own client: the request is built, its
``If-None-Match`` header set, not yet sent) until the test lets it go; and the exclusive upload itself,
single PUT and multipart (If-None-Match on CompleteMultipartUpload)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from boto3.s3.transfer import TransferConfig
from botocore.awsrequest import AWSResponse, HTTPHeaders

import store.s3
from store.errors import ObjectExists
from store.s3 import S3Backend
from tests.unit.test_store_takeover_inflight import (
    Gate,
    race_landing_before_the_takeovers_upload,
    race_late_landing,
)
from tools.seaweed_server import EmbeddedSeaweed

BUCKET = "fleet-models"


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=2) as executor:
        yield executor


class HeldPut:
    """Push A's backend: a client of its own whose first PutObject of a key waits at a gate before it is sent."""

    def __init__(self, s3: EmbeddedSeaweed) -> None:
        self.s3 = s3
        self.headers: dict[str, Any] = {}
        """The held request's headers (If-None-Match among them)."""

    def __call__(self, key: str, gate: Gate) -> S3Backend:
        client = self.s3.client()

        def hold(request: Any, **_kwargs: Any) -> None:
            if request.url.split("?")[0].endswith(f"/{BUCKET}/{key}") and not gate.held.is_set():
                self.headers = dict(request.headers)
                gate.hold()

        client.meta.events.register("before-send.s3.PutObject", hold)
        return S3Backend(BUCKET, endpoint_url=self.s3.endpoint_url, client=client)


def _version() -> str:
    return f"1.0.0-{uuid.uuid4().hex[:8]}"


def test_an_in_flight_put_landing_after_the_takeover_is_refused_on_s3(
    s3: EmbeddedSeaweed, tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    """Before: A's PUT replaced B's published model file (every fetch: ChecksumMismatch)."""
    held = HeldPut(s3)
    backend = S3Backend(BUCKET, endpoint_url=s3.endpoint_url, client=s3.client())
    race_late_landing(pool, backend, held, tmp_path, _version())
    assert held.headers.get("If-None-Match") == b"*"  # the held request was already conditional


def test_a_takeover_stops_when_the_replaced_push_lands_a_file_first_on_s3(
    s3: EmbeddedSeaweed, tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    backend = S3Backend(BUCKET, endpoint_url=s3.endpoint_url, client=s3.client())
    race_landing_before_the_takeovers_upload(pool, backend, HeldPut(s3), tmp_path, _version())


@pytest.mark.parametrize("size_bytes", [1 << 10, 6 << 20], ids=["put", "multipart"])
def test_an_exclusive_upload_never_replaces_an_object(
    s3: EmbeddedSeaweed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size_bytes: int
) -> None:
    """The second exclusive upload of a key is refused and the first one's bytes stay (multipart: 5 MiB
    parts, so a 6 MiB file is a two-part upload whose completion carries If-None-Match)."""
    monkeypatch.setattr(store.s3, "_TRANSFER", TransferConfig(multipart_threshold=5 << 20,
                                                              multipart_chunksize=5 << 20, max_concurrency=2))
    backend = S3Backend(BUCKET, endpoint_url=s3.endpoint_url, client=s3.client())
    key = f"exclusive/{uuid.uuid4().hex}/blob.bin"
    first, second = tmp_path / "first.bin", tmp_path / "second.bin"
    first.write_bytes(b"1" * size_bytes)
    second.write_bytes(b"2" * size_bytes)
    assert backend.upload(key, first, exclusive=True) == size_bytes
    with pytest.raises(ObjectExists) as err:
        backend.upload(key, second, exclusive=True)
    assert err.value.field == key and "already exists" in str(err.value)
    assert backend.read(key) == first.read_bytes()
    assert backend.upload(key, second) == size_bytes  # not exclusive: replaced as before
    assert backend.read(key) == second.read_bytes()
    uploads = backend.client.list_multipart_uploads(Bucket=BUCKET, Prefix=key).get("Uploads", [])
    assert uploads == [], "a refused multipart upload is aborted, not left open"


class _Body:
    """The raw body botocore reads an :class:`AWSResponse` from."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def stream(self, **_kwargs: Any) -> Iterator[bytes]:
        yield self.data


def test_a_server_without_conditional_puts_gets_check_then_upload(
    s3: EmbeddedSeaweed, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A server that answers 501 to If-None-Match (simulated on the client: the request never leaves) gets
    today's documented fallback for uploads too: a warning, then HEAD and a plain upload (racy by nature)."""
    client = s3.client()

    def not_implemented(request: Any, **_kwargs: Any) -> AWSResponse | None:
        if "If-None-Match" not in request.headers:
            return None
        error = b"<Error><Code>NotImplemented</Code><Message>If-None-Match</Message></Error>"
        return AWSResponse(request.url, 501, HTTPHeaders(), _Body(error))

    # a before-send handler that returns a response answers in the server's place (the stubs say None only)
    client.meta.events.register("before-send.s3.PutObject", not_implemented)  # type: ignore[arg-type]
    backend = S3Backend(BUCKET, endpoint_url=s3.endpoint_url, client=client)
    key = f"exclusive/{uuid.uuid4().hex}/blob.bin"
    (tmp_path / "blob.bin").write_bytes(b"first")
    with caplog.at_level("WARNING", logger="fleet.store"):
        assert backend.upload(key, tmp_path / "blob.bin", exclusive=True) == 5
    assert "does not support conditional puts" in caplog.text and not backend._conditional
    with pytest.raises(ObjectExists):
        backend.upload(key, tmp_path / "blob.bin", exclusive=True)
