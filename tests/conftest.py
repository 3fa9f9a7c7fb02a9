"""Fixtures shared by the integration tiers (integration/, gpu_wheel/): a real redis-server on a free
port, real models, real worker processes. Unit tests use none of them."""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.integration.fleet_fixtures import Fleet
from tools import test_order
from tools.build_encoder import build_encoder
from tools.build_llama import build_llama
from tools.build_lm import build_causal_lm
from tools.redis_server import EmbeddedRedis


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo LMs (GPT-style and Llama-style) and encoder, built once per session from their fixed seeds."""
    root = tmp_path_factory.mktemp("models")
    build_causal_lm(root)
    build_llama(root)
    build_encoder(root)
    return root


@pytest.fixture
def redis_server() -> Iterator[EmbeddedRedis]:
    """A private redis-server for one test (flushed before use; tests may kill and restart it)."""
    server = EmbeddedRedis().start()
    redis.Redis(port=server.port).flushall()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def fleet(tmp_path: Path, model_dir: Path, redis_server: EmbeddedRedis) -> Iterator[Fleet]:
    """Config writer + worker/client factory; everything it started is stopped afterwards."""
    f = Fleet(tmp_path, model_dir, redis_server.url)
    try:
        yield f
    finally:
        f.close()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run test files longest first (:mod:`tools.test_order`): with ``make test``'s ``--dist loadfile
    --no-loadscope-reorder`` the processes take files in this order, so a long file is not left for last.
    Within a file the order is unchanged."""
    by_file: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    try:
        seconds = json.loads(test_order.FILE_SECONDS.read_text())
    except (OSError, ValueError):
        seconds = {}
    order = test_order.longest_first(list(by_file), {f: len(v) for f, v in by_file.items()}, seconds)
    items[:] = [item for f in order for item in by_file[f]]


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection built (imported modules, hypothesis strategies, the items: about 200,000 objects)
    out of the garbage collector: every full collection then skips them. :meth:`EmbeddedRedis.stop
    <tools.redis_server.EmbeddedRedis.stop>` runs one at each test's end, which scanned them all (0.18 s each
    on this machine; 0.01 s frozen)."""
    gc.collect()
    gc.freeze()
