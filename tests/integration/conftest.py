"""Fixtures shared by integration modules: a real S3 server, a Redis link a test can cut, and a port taken.

One SeaweedFS per test session (its start-up costs ~5–20 s on this machine): defined here, not
imported into each module, because a session fixture imported into N modules is N fixtures.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from store.model_store import ModelStore
from store.s3 import S3Backend
from tests.integration.redis_cut_proxy import CutProxy
from tools.redis_server import EmbeddedRedis, free_port
from tools.seaweed_server import EmbeddedSeaweed

BUCKET = "fleet-models"


def s3_model_store(s3: EmbeddedSeaweed, cache_dir: Path) -> ModelStore:
    """A model store on ``s3``'s :data:`BUCKET`, through the server's own boto3 client, caching in ``cache_dir``."""
    return ModelStore(S3Backend(BUCKET, endpoint_url=s3.endpoint_url, client=s3.client()), cache_dir)


@pytest.fixture(scope="session")
def seaweed() -> Iterator[EmbeddedSeaweed]:
    """One SeaweedFS (weed server -s3) for the session; killed and its data removed at the end."""
    server = EmbeddedSeaweed(bucket=BUCKET).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3(seaweed: EmbeddedSeaweed, monkeypatch: pytest.MonkeyPatch) -> EmbeddedSeaweed:
    """The session's server, its credentials and FLEET_STORE__* in this process's environment (and so
    in the workers it starts): the fleet reads credentials from the environment only."""
    for key, value in seaweed.env().items():
        monkeypatch.setenv(key, value)
    return seaweed


@pytest.fixture
def proxy(redis_server: EmbeddedRedis) -> Iterator[CutProxy]:
    """A :class:`~tests.integration.redis_cut_proxy.CutProxy` in front of the test's redis-server."""
    p = CutProxy(redis_server.port)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another process (here: the test) listens on: a server's bind of it fails."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def picks_first(port: int) -> Callable[[], int]:
    """A stand-in for ``free_port`` that answers ``port`` once, then free ports."""
    answers = iter([port])
    return lambda: next(answers, None) or free_port()
