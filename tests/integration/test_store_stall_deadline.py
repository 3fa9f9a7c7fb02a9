"""A model file's download from a stalled store ends at ``store.fetch_stall_timeout_s``, whatever s3transfer retries.

Before, each socket read waited the read timeout (60 s), each request was tried 4 times, and s3transfer asked
again for a body that stalled up to 5 times: about 20 min before the download ended. Now a download that
receives no byte for ``store.fetch_stall_timeout_s`` is cancelled and raises a StoreError naming the key and
that deadline (:mod:`store.s3`). Here the deadline is 1 s and the read timeout stays 60 s: the old code could
only end after minutes (the wait below bounds a failure, it is not a measurement).

Real SeaweedFS (S3 API), stopped with SIGSTOP: before the download starts, and once the body began to arrive
(a file larger than the sockets' buffers).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from protocol.settings_store import StoreSettings
from store.errors import StoreError
from store.model_store import open_store
from store.s3 import S3Backend
from tests.integration.conftest import BUCKET
from tools.seaweed_server import EmbeddedSeaweed
from workers.load_retry import transient

pytestmark = pytest.mark.timeout(180)

STALL_S = 1.0
"""``store.fetch_stall_timeout_s`` of the test's store."""
FAILURE_BOUND_S = 90.0
"""Bound of the wait for a download to end (s): a failure bound only (the read timeout stays 60 s)."""


def _ended(download: Callable[[], None]) -> BaseException | None:
    """What ``download`` raised (None: it returned), waiting at most :data:`FAILURE_BOUND_S` for it."""
    with ThreadPoolExecutor(1) as pool:
        done: Future[None] = pool.submit(download)
        try:
            return done.exception(FAILURE_BOUND_S)
        except TimeoutError:
            pytest.fail(f"the download did not end within {FAILURE_BOUND_S} s of a {STALL_S} s stall deadline")


def test_a_stalled_download_ends_at_the_stall_deadline(s3: EmbeddedSeaweed, tmp_path: Path) -> None:
    store = open_store(StoreSettings(backend="s3", bucket=BUCKET, endpoint_url=s3.endpoint_url,
                                     fetch_stall_timeout_s=STALL_S, cache_dir=tmp_path / "cache"))  # fmt: skip
    backend = store.backend
    assert isinstance(backend, S3Backend) and backend.fetch_stall_timeout_s == STALL_S
    key = "stall-test/big.bin"
    (tmp_path / "big.bin").write_bytes(os.urandom(32 << 20))  # more than the sockets' buffers hold
    backend.upload(key, tmp_path / "big.bin")
    assert s3.proc is not None
    pid = s3.proc.pid
    stalled = threading.Event()

    def stall(_n: int) -> None:  # the body began to arrive: the store stops in the middle of it
        if not stalled.is_set():
            stalled.set()
            os.kill(pid, signal.SIGSTOP)

    try:
        mid_body = _ended(lambda: backend.download(key, tmp_path / "mid-body.copy", stall))
    finally:
        os.kill(pid, signal.SIGCONT)
    os.kill(pid, signal.SIGSTOP)  # before the request: connections are accepted (the backlog), never answered
    try:
        at_start = _ended(lambda: backend.download(key, tmp_path / "at-start.copy"))
    finally:
        os.kill(pid, signal.SIGCONT)
    assert stalled.is_set()
    for error in (mid_body, at_start):
        assert isinstance(error, StoreError), repr(error)
        assert error.field == key and error.limit == STALL_S, (error.field, error.limit)
        assert f"s3://{BUCKET}/{key}" in str(error) and "no byte for 1 s (store.fetch_stall_timeout_s)" in str(error)
        assert transient(error)  # the reconciler tries a load that stalled so again
    assert not (tmp_path / "mid-body.copy").exists() and not (tmp_path / "at-start.copy").exists()
    # the store answers again: the same backend completes a download. Its deadline is widened first: a store just
    # woken (and a machine under load) may well be silent for 1 s before its first byte, which is not the subject
    backend.fetch_stall_timeout_s = FAILURE_BOUND_S
    backend.download(key, tmp_path / "after.copy")
    assert (tmp_path / "after.copy").read_bytes() == (tmp_path / "big.bin").read_bytes()


def test_the_deadline_is_a_positive_number_of_seconds() -> None:
    with pytest.raises(ValueError, match="fetch_stall_timeout_s\n  Input should be greater than 0"):
        StoreSettings(fetch_stall_timeout_s=0)
