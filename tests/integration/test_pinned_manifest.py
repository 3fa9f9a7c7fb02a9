"""A pinned version means the bytes that were pinned, not whatever the store holds under its name later.

A pin or canary records the sha256 of the version's manifest; a worker fetching the version after its bytes
were replaced in the store (deleted and pushed again with other weights, or written over in the bucket)
refuses it ("manifest of … changed since it was pinned"), visibly (heartbeat ``last_refusal``, the model's
refusals, ``fleet status``), instead of serving other bytes under the pinned name beside workers that serve
the cached pinned ones. Before, the pin recorded the name only: a fresh worker served the new bytes silently.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from producer.cli import main as fleet_main
from protocol.errors import ModelLoadError
from protocol.keys import WORKER_KEY_PREFIX
from protocol.model_state import history, pin, promote, read_state, refusals, rollback, set_canary
from store import ModelStore
from store.errors import VersionNotFound
from store.local import LocalBackend
from store.manifest import manifest_digest
from tests.integration.conftest import s3_model_store
from tests.integration.fleet_fixtures import Fleet
from tests.integration.lifecycle_fixtures import BUCKET, collect, lifecycle_config, publish, wait_until
from tests.integration.model_versions import MODEL, build_version, top1_logprob
from tools.redis_server import EmbeddedRedis
from tools.seaweed_server import EmbeddedSeaweed


def _beat(r: redis.Redis[bytes], host: str) -> dict[str, object]:
    doc: dict[str, object] = json.loads(r.get(WORKER_KEY_PREFIX + host) or b"{}")
    return doc


def _replace(store: ModelStore, s3: EmbeddedSeaweed, tmp_path: Path, version: str, scale: float) -> None:
    """Delete every object of ``version`` from the bucket and push other weights under the same name."""
    client = s3.client()
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=f"{MODEL}/{version}/")
    for obj in listed.get("Contents", []):
        client.delete_object(Bucket=BUCKET, Key=obj["Key"])
    store.push(build_version(tmp_path / "rebuilt", version, scale), MODEL, version)


def test_a_fresh_worker_refuses_a_pinned_version_whose_bytes_were_replaced(
    fleet: Fleet, s3: EmbeddedSeaweed, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    configured, pinned = publish(s3, tmp_path, 1.0), publish(s3, tmp_path, 2.0)
    store = s3_model_store(s3, tmp_path / "push-cache")
    r = redis.Redis.from_url(fleet.redis_url)
    pin(r, MODEL, pinned.version, "test@pinned", store=store)
    digest = manifest_digest(store.manifest_bytes(MODEL, pinned.version))

    w1 = fleet.worker(lifecycle_config(fleet, s3, configured.version, tmp_path / "cache-1"), MODEL,
                      hostname="w1-pinned@test")
    assert _beat(r, w1.hostname).get("version") == pinned.version, w1.log_tail(4000)

    _replace(store, s3, tmp_path, pinned.version, 3.0)
    replaced = manifest_digest(store.manifest_bytes(MODEL, pinned.version))
    assert replaced != digest

    cfg = lifecycle_config(fleet, s3, configured.version, tmp_path / "cache-2")
    w2 = fleet.worker(cfg, MODEL, hostname="w2-pinned@test")  # empty cache: it must fetch the version
    beat = _beat(r, w2.hostname)
    refusal = beat.get("last_refusal")
    assert beat.get("version") != pinned.version, f"w2 serves {pinned.version}'s replaced bytes: {beat}"
    assert isinstance(refusal, dict) and refusal["error_type"] == "ChecksumMismatch", beat
    expected = (f"manifest of {MODEL} {pinned.version} changed since it was pinned (sha256 {digest} pinned, "
                f"{replaced} now")
    assert expected in refusal["error"] and "pin it again to accept the new bytes" in refusal["error"]
    assert any(x.worker == w2.hostname and expected in x.error for x in refusals(r, MODEL))
    state = read_state(r, MODEL)
    assert state is not None and state.stable_manifest_sha256 == digest  # what the pin recorded

    # w1 keeps the pinned bytes (its cache was made from the pinned manifest); no result carries the new ones
    client = fleet.client(cfg)
    ids = [client.submit(MODEL, text=f"pinned {i}", top_k=1) for i in range(20)]
    results, failures = collect(client, ids)
    assert not failures and len(results) == len(ids)
    for x in results:
        assert x.top_k is not None
        if x.version == pinned.version:
            assert abs(x.top_k[0].logprob - pinned.logprob) < 1e-4, "a result of the replaced bytes"
            assert x.timings.worker == w1.hostname

    # fleet status shows the refusal
    capsys.readouterr()
    assert fleet_main(["status", "--json", "--config", str(cfg)]) == 0
    row = next(m for m in json.loads(capsys.readouterr().out)["models"] if m["model"] == MODEL)
    assert any(x["worker"] == w2.hostname and expected in x["error"] for x in row["last_refusals"]), row
    assert row["stable_manifest_sha256"] == digest
    assert fleet_main(["status", "--config", str(cfg)]) == 0
    text = capsys.readouterr().out
    assert f"{MODEL}: {pinned.version} @{digest[:12]} (generation" in text, text  # the pinned manifest's prefix

    # pinning it again accepts the new bytes: w2 loads them, and w1 drops its cached old bytes for them
    pin(r, MODEL, pinned.version, "test@pinned", store=store)
    state = read_state(r, MODEL)
    assert state is not None and state.stable_manifest_sha256 == replaced
    swapped = f"serves {MODEL} {pinned.version} as stable from the next batch"  # w1 held the name already
    wait_until(lambda: all(swapped in w.log_tail(200_000) for w in (w1, w2)), 60,
               f"both workers swapped in the new bytes of {pinned.version}")
    assert all(_beat(r, w.hostname).get("version") == pinned.version for w in (w1, w2))
    ids = [client.submit(MODEL, text=f"re-pinned {i}", top_k=1) for i in range(20)]
    results, failures = collect(client, ids)
    assert not failures and {x.version for x in results} == {pinned.version}
    assert all(x.top_k is not None and abs(x.top_k[0].logprob - top1_logprob(3.0)) < 1e-4 for x in results), \
        {(x.timings.worker, x.top_k[0].logprob if x.top_k else None) for x in results}


def test_a_cached_copy_of_another_manifest_is_not_used_and_old_records_check_nothing(
    fleet: Fleet, tmp_path: Path
) -> None:
    """Local store, no worker: the pin's digest reaches the fetch; a cache made from the replaced manifest is
    not used; a pin recorded without a digest (before this change, or without a store) still loads anything."""
    store = ModelStore(LocalBackend(tmp_path / "store"), tmp_path / "cache")
    version = "1.0.0"
    store.push(build_version(tmp_path / "built-a", version, 2.0), MODEL, version)
    r = redis.Redis.from_url(fleet.redis_url)
    pin(r, MODEL, version, "test@pinned", store=store)
    state = read_state(r, MODEL)
    assert state is not None and state.stable_manifest_sha256 == store.manifest_sha256(MODEL, version)
    digest = state.stable_manifest_sha256

    root = tmp_path / "store" / MODEL / version
    for path in sorted(root.rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    store.push(build_version(tmp_path / "built-b", version, 3.0), MODEL, version)
    store.fetch(MODEL, version)  # a cache copy made from the replaced manifest (no digest asked)

    with pytest.raises(ModelLoadError, match="changed since it was pinned") as caught:
        store.fetch(MODEL, version, manifest_sha256=digest)
    assert caught.value.field == "manifest_sha256" and f"sha256 {digest} pinned" in str(caught.value)
    assert not (tmp_path / "cache" / MODEL / version).exists()  # the other manifest's copy is not kept for it

    pin(r, MODEL, version, "test@old-record")  # no store: no digest recorded, as in records made before
    state = read_state(r, MODEL)
    assert state is not None and state.stable_manifest_sha256 is None
    assert store.fetch(MODEL, version, manifest_sha256=state.stable_manifest_sha256).is_file()


def test_each_change_records_or_carries_the_manifest_digest(redis_server: EmbeddedRedis, tmp_path: Path) -> None:
    """pin and canary record the digest read from the store; promote, rollback and the rollback stack carry
    it; a rollback to a version pinned before digests were recorded takes its manifest's digest now."""
    store = ModelStore(LocalBackend(tmp_path / "store"), tmp_path / "cache")
    digests = {}
    for i, version in enumerate(("1.0.0", "2.0.0", "3.0.0")):
        store.push(build_version(tmp_path / f"built-{i}", version, 1.0 + i), MODEL, version)
        digests[version] = store.manifest_sha256(MODEL, version)
    r = redis.Redis(port=redis_server.port)

    def now() -> tuple[str | None, str | None, str | None, str | None]:
        s = read_state(r, MODEL)
        assert s is not None
        return s.stable, s.stable_manifest_sha256, s.canary, s.canary_manifest_sha256

    pin(r, MODEL, "1.0.0", "t")  # no store: nothing recorded (as in a record made before digests)
    assert now() == ("1.0.0", None, None, None)
    pin(r, MODEL, "2.0.0", "t", store=store)
    assert now() == ("2.0.0", digests["2.0.0"], None, None)
    set_canary(r, MODEL, "3.0.0", 10, "t", store=store)
    assert now() == ("2.0.0", digests["2.0.0"], "3.0.0", digests["3.0.0"])
    rollback(r, MODEL, "t")  # drops the canary, keeps the stable digest
    assert now() == ("2.0.0", digests["2.0.0"], None, None)
    set_canary(r, MODEL, "3.0.0", 10, "t", store=store)
    promote(r, MODEL, "t")
    assert now() == ("3.0.0", digests["3.0.0"], None, None)
    assert history(r, MODEL, last=1)[0].to.stable_manifest_sha256 == digests["3.0.0"]
    rollback(r, MODEL, "t")  # undoes the promote: back to 2.0.0 with the digest it was pinned with
    assert now() == ("2.0.0", digests["2.0.0"], None, None)
    rollback(r, MODEL, "t", store=store)  # undoes the pin: 1.0.0 was pinned without one, the store's now
    assert now() == ("1.0.0", digests["1.0.0"], None, None)
    with pytest.raises(VersionNotFound):
        pin(r, MODEL, "9.9.9", "t", store=store)
