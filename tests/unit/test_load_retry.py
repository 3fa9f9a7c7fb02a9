"""Which failed loads are tried again (workers.load_retry): the store's transient failures, with a backoff.

The errors are the ones :class:`store.s3.S3Backend` really raises: its calls go through botocore with a hook
that fails the request the way a dead, hung or overloaded store does (no network), or through botocore's
Stubber for the answers of a store that is up.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import (
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    ReadTimeoutError,
)
from botocore.response import StreamingBody
from botocore.stub import Stubber

from protocol.errors import IncompatibleVersion, ModelLoadError
from store.errors import CacheUnwritable, ChecksumMismatch, StoreError, VersionNotFound
from store.s3 import S3Backend
from workers.load_retry import MAX_RETRY_WAIT_S, LoadRetries, StoreOutage, transient
from workers.reconcile_plan import Retry

URL = "http://127.0.0.1:9"
BUCKET = "models"


def _backend(fail: Callable[[], None] | None = None, **backend: Any) -> S3Backend:
    """A backend whose every request ends in ``fail()`` (one attempt: no retries), before any byte is sent."""
    client = boto3.session.Session().client(
        "s3", endpoint_url=URL, region_name="us-east-1", aws_access_key_id="k", aws_secret_access_key="s",
        config=Config(s3={"addressing_style": "path"}, retries={"total_max_attempts": 1, "mode": "standard"}),
    )
    if fail is not None:
        client.meta.events.register("before-send.s3.*", lambda **_: fail())
    return S3Backend(BUCKET, endpoint_url=URL, client=client, **backend)


def _raise(exc: BaseException) -> Callable[[], None]:
    def fail() -> None:
        raise exc

    return fail


def _read_error(backend: S3Backend) -> StoreError:
    with pytest.raises(StoreError) as raised:
        backend.read("m/1/manifest.json")
    return raised.value


def _answered(code: str, status: int) -> StoreError:
    backend = _backend()
    with Stubber(backend.client) as stub:
        stub.add_client_error("get_object", service_error_code=code, http_status_code=status)
        return _read_error(backend)


@pytest.mark.parametrize(
    "exc",
    [
        EndpointConnectionError(endpoint_url=URL),  # nothing listens: "Could not connect to the endpoint URL"
        ConnectTimeoutError(endpoint_url=URL),
        ReadTimeoutError(endpoint_url=URL),  # a hung store
        ConnectionClosedError(endpoint_url=URL),  # a reset
    ],
    ids=lambda exc: type(exc).__name__,
)
def test_a_store_that_does_not_answer_is_transient(exc: BaseException) -> None:
    error = _read_error(_backend(_raise(exc)))
    assert type(error) is StoreError and transient(error), repr(error)


@pytest.mark.parametrize(("code", "status"), [("InternalError", 500), ("ServiceUnavailable", 503),
                                              ("SlowDown", 503), ("BadGateway", 502), ("Whatever", 504)])
def test_an_s3_5xx_or_throttle_is_transient(code: str, status: int) -> None:
    assert transient(_answered(code, status))


@pytest.mark.parametrize(("code", "status"), [("AccessDenied", 403), ("NoSuchBucket", 404),
                                              ("InvalidRequest", 400)])
def test_a_store_that_answers_no_gives_a_verdict(code: str, status: int) -> None:
    assert not transient(_answered(code, status))


def test_missing_credentials_and_an_oversized_object_are_verdicts() -> None:
    assert not transient(_read_error(_backend(_raise(NoCredentialsError()))))
    backend = _backend()
    with Stubber(backend.client) as stub:
        stub.add_response("get_object", {"ContentLength": 10, "Body": StreamingBody(io.BytesIO(b"0123456789"), 10)})
        with pytest.raises(StoreError) as raised:
            backend.read("m/1/manifest.json", max_bytes=4)
    assert raised.value.field == "max_bytes" and not transient(raised.value)


@pytest.fixture
def hung() -> Iterator[threading.Event]:
    """Set at the end of the test: the requests held in the hook (a store that never answers) go on."""
    release = threading.Event()
    yield release
    release.set()


def test_a_download_stalled_past_its_deadline_is_transient(hung: threading.Event, tmp_path: Path) -> None:
    backend = _backend(lambda: hung.wait(30) and None, fetch_stall_timeout_s=0.2)
    with pytest.raises(StoreError) as raised:
        backend.download("m/1/model.onnx", tmp_path / "model.onnx")
    assert raised.value.limit == 0.2 and "received no byte" in str(raised.value), raised.value
    assert transient(raised.value)


@pytest.mark.parametrize(
    "exc",
    [
        VersionNotFound("m 1 is not published", "version", "1"),
        ChecksumMismatch("model.onnx has sha256 a, the manifest says b", "model.onnx", "b"),
        IncompatibleVersion("vocab_size 10, the model's is 12", "vocab_size", 12),
        ModelLoadError("the graph does not fit", "path", "x"),
        CacheUnwritable("cannot write into the cache", "store.cache_dir", "/c"),
        StoreError("key 'x' leaves the store directory /s", "key", "x"),  # a local store's refusal
        OSError("no such file"),
        RuntimeError("ORT: invalid graph"),
    ],
    ids=lambda exc: type(exc).__name__,
)
def test_a_verdict_about_the_version_is_not_transient(exc: BaseException) -> None:
    assert not transient(exc)


def test_waits_double_from_the_interval_to_the_cap_and_start_over_after_a_load() -> None:
    retries = LoadRetries(first_wait_s=2.0, max_wait_s=20.0)
    outages = [retries.failed("v2", 4, now_s) for now_s in (100.0, 102.0, 106.0, 114.0, 130.0, 150.0)]
    assert [o.wait_s for o in outages] == [2.0, 4.0, 8.0, 16.0, 20.0, 20.0]
    assert [o.failures for o in outages] == [1, 2, 3, 4, 5, 6]  # only the first is logged
    assert {o.since_s for o in outages} == {100.0}
    assert retries.pending == {"v2": Retry(generation=4, at_s=170.0)}
    assert retries.ended("v2") == StoreOutage(since_s=100.0, failures=6, wait_s=20.0)
    assert retries.pending == {} and retries.ended("v2") is None
    assert retries.failed("v2", 5, 200.0) == StoreOutage(since_s=200.0, failures=1, wait_s=2.0)  # a new outage


def test_a_state_change_during_an_outage_does_not_start_it_again() -> None:
    retries = LoadRetries(first_wait_s=5.0)
    retries.failed("v2", 4, 0.0)
    assert retries.failed("v2", 5, 1.0) == StoreOutage(since_s=0.0, failures=2, wait_s=10.0)
    assert retries.pending["v2"] == Retry(generation=5, at_s=11.0)


def test_the_default_cap_is_a_few_minutes_and_each_version_has_its_own_outage() -> None:
    retries = LoadRetries(first_wait_s=5.0)
    waits = [retries.failed("v2", 1, float(i)).wait_s for i in range(10)]
    assert waits[-1] == MAX_RETRY_WAIT_S == 180.0 and retries.failed("v3", 1, 0.0).failures == 1
    retries.retain({"v3", None})  # the state no longer names v2: its outage is forgotten
    assert set(retries.pending) == {"v3"} and retries.failed("v2", 2, 20.0).failures == 1
