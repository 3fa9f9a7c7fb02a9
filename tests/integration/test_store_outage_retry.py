"""A worker that could not load the pinned version because the store was down converges once it is back.

A real worker starts while its real S3 store (SeaweedFS) is stopped and a version is pinned: it cannot fetch the
pin and serves its configured version (cached). The store then starts again on the same port and data folder.
A store that did not answer is no verdict on the version: the worker's periodic re-read tries the pin again
(backing off from ``worker.reconcile_interval_s``) and serves it, with no new pin. Before, the failure was a
refusal kept until the state's generation changed, so the worker served its configured version (a second
stable version in the fleet) until someone pinned again. The outage is logged and recorded once, not per try.
The test waits on the worker's heartbeat and log, never on a clock.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

import workers.reconcile
from protocol.keys import WORKER_KEY_PREFIX
from protocol.model_state import pin, read_state, refusals
from tests.integration.conftest import s3_model_store
from tests.integration.fleet_fixtures import Fleet
from tests.integration.lifecycle_fixtures import BUCKET, lifecycle_config, publish, wait_until
from tests.integration.model_versions import MODEL
from tools.seaweed_server import EmbeddedSeaweed

ROOT = Path(__file__).resolve().parents[2]
BY = "test@store-outage"
CONVERGE_S = 120
"""Failure bound of the wait for the pin to be served once the store answers (the backoff's wait at that point
is at most about the outage's length so far)."""

pytestmark = pytest.mark.timeout(420)


class Stores:
    """One private SeaweedFS, stopped and started again on the same S3 port, data folder and keys."""

    def __init__(self, data_dir: Path) -> None:
        self.current = EmbeddedSeaweed(bucket=BUCKET, data_dir=data_dir).start()

    def stop(self) -> None:
        self.current.stop()

    def restart(self) -> EmbeddedSeaweed:
        was = self.current
        self.current = EmbeddedSeaweed(was.s3_port, data_dir=was.data_dir, bucket=BUCKET, access_key=was.access_key,
                                       secret_key=was.secret_key).start()  # fmt: skip
        return self.current


@pytest.fixture
def stores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Stores]:
    """A store of this test's own (the session's must not stop), its credentials in the workers' environment."""
    s = Stores(tmp_path / "seaweed")
    for key, value in s.current.env().items():
        monkeypatch.setenv(key, value)
    try:
        yield s
    finally:
        s.stop()


def _beat(r: redis.Redis[bytes], host: str) -> dict[str, object]:
    doc: dict[str, object] = json.loads(r.get(WORKER_KEY_PREFIX + host) or b"{}")
    return doc


def test_a_worker_started_during_a_store_outage_serves_the_pin_once_the_store_is_back(
    fleet: Fleet, stores: Stores, tmp_path: Path
) -> None:
    assert Path(workers.reconcile.__file__).resolve().is_relative_to(ROOT)  # the code under test
    store = stores.current
    configured, pinned = (publish(store, tmp_path, scale) for scale in (1.0, 2.0))
    cache = tmp_path / "cache"
    s3_model_store(store, cache).fetch(MODEL, configured.version)  # the configured version is cached, the pin not
    r = redis.Redis.from_url(fleet.redis_url)
    pin(r, MODEL, pinned.version, BY, store=s3_model_store(store, tmp_path / "pin-cache"))
    state = read_state(r, MODEL)
    assert state is not None and state.stable == pinned.version and state.stable_manifest_sha256

    stores.stop()
    worker = fleet.worker(lifecycle_config(fleet, store, configured.version, cache), MODEL, hostname="w-outage@test")
    assert _beat(r, worker.hostname).get("version") == configured.version, worker.log_tail(4000)

    stores.restart()  # same port, same data: the pinned version is there again
    wait_until(lambda: _beat(r, worker.hostname).get("version") == pinned.version, CONVERGE_S,
               f"the worker serving the pinned {pinned.version} once the store is back, with no new pin")
    after = read_state(r, MODEL)
    assert after is not None and after.generation == state.generation  # nobody pinned again

    log = worker.log_tail(400_000)
    failed = f"cannot load {MODEL} {pinned.version} for now, at start"
    assert log.count(failed) == 1 and "Could not connect to the endpoint URL" in log, log[-4000:]
    assert f"refuses {MODEL} {pinned.version}" not in log, log[-4000:]
    assert f"loaded {MODEL} {pinned.version}: the store answers again after" in log, log[-4000:]
    recorded = [x for x in refusals(r, MODEL) if x.worker == worker.hostname]
    assert [(x.version, x.error_type) for x in recorded] == [(pinned.version, "StoreError")]  # once per outage
