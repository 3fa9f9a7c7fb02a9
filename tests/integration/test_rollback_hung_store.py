"""A rollback is the emergency stop: a model store that accepts connections and never answers does not hold it up.

Undoing a pin asks the store whether the version it returns to is still published. A store that cannot be
reached already let the rollback through (connection refused: at once), but one that accepts and never answers
(a hung S3 gateway, a stopped process whose port still takes connections) held ``fleet models rollback`` for the
S3 client's whole retry budget: 60 s reads, four tries, four minutes, with nothing said. Now the check waits
``protocol.model_changes.STORE_CHECK_WAIT_S`` (5 s) and the rollback goes through without it. Real redis-server,
a real boto3 S3 client, a real socket that never answers.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from protocol.model_changes import STORE_CHECK_WAIT_S, pin, rollback
from protocol.model_records import read_state
from protocol.settings_store import StoreSettings
from store.model_store import open_store
from tools.redis_server import EmbeddedRedis

MODEL = "demo-lm"


@pytest.fixture
def hung_endpoint() -> Iterator[str]:
    """An HTTP endpoint whose port takes connections (the kernel's backlog) and never answers a byte."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()


@pytest.mark.timeout(120)  # the old code waited 240 s: a timeout here is the failure
def test_a_rollback_goes_through_when_the_store_never_answers(
    redis_server: EmbeddedRedis, hung_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test-key-id")  # signed requests: boto3 needs some credentials
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test-secret")
    r: redis.Redis[bytes] = redis_server.client()
    pin(r, MODEL, "1.0.1", "test@rollback")
    pin(r, MODEL, "1.0.2", "test@rollback")
    store = open_store(StoreSettings(backend="s3", endpoint_url=hung_endpoint, bucket="models",
                                     cache_dir=tmp_path / "cache"))  # fmt: skip
    with caplog.at_level("WARNING", logger="fleet.models"):
        entry = rollback(r, MODEL, "test@rollback", store=store)
    state = read_state(r, MODEL)
    assert state is not None and state.stable == "1.0.1", state
    assert entry.action == "rollback", entry
    assert f"did not answer within {STORE_CHECK_WAIT_S:g} s whether 1.0.1 is still published" in caplog.text
