"""A refused pin leaves one stable version in service, and says so.

Two real workers serve versions published to a real S3 server (SeaweedFS). With 2.0.0 serving
and a corrupted version pinned (refused by every worker), a restarted worker must serve the last
version the fleet served, not its configured one, or stable traffic splits between two versions;
``fleet models pin`` and ``fleet status`` say that the desired version is not the one served, and
a refusal the state has moved past is marked superseded.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

import workers.reconcile
from producer.cli import main as fleet_main
from protocol.keys import WORKER_KEY_PREFIX
from protocol.model_served import read_served
from protocol.model_state import pin, refusals
from store.manifest import manifest_digest
from tests.integration.fleet_fixtures import Fleet
from tests.integration.lifecycle_fixtures import BUCKET, collect, lifecycle_config, publish, wait_until
from tests.integration.model_versions import MODEL
from tools.seaweed_server import EmbeddedSeaweed

ROOT = Path(__file__).resolve().parents[2]


def _show(capsys: pytest.CaptureFixture[str], text: str) -> None:
    with capsys.disabled():  # the figures, outside what the test reads from fleet's output
        print(text)


def _beat(r: redis.Redis[bytes], host: str) -> dict[str, object]:
    doc: dict[str, object] = json.loads(r.get(WORKER_KEY_PREFIX + host) or b"{}")
    return doc


def test_a_worker_restarted_under_a_refused_pin_serves_the_last_served_version(
    fleet: Fleet, s3: EmbeddedSeaweed, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert Path(workers.reconcile.__file__).resolve().is_relative_to(ROOT)  # the code under test
    configured, good, bad = (publish(s3, tmp_path, scale) for scale in (1.0, 2.0, 3.0))
    key = f"{MODEL}/{bad.version}/{MODEL}-{bad.version}.onnx"
    original = s3.client().get_object(Bucket=BUCKET, Key=key)["Body"].read()
    s3.client().put_object(Bucket=BUCKET, Key=key, Body=original[:-8] + b"tampered")
    cfg = lifecycle_config(fleet, s3, configured.version, tmp_path / "cache")
    w1, w2 = (fleet.worker(cfg, MODEL, hostname=f"w{i}-served@test") for i in (1, 2))
    r = redis.Redis.from_url(fleet.redis_url)

    pin(r, MODEL, good.version, "test@served")
    wait_until(lambda: all(_beat(r, w.hostname).get("version") == good.version for w in (w1, w2)), 60,
               f"both workers on {good.version}")

    # the corrupted pin, through the CLI: it waits for the workers' verdicts and says the pin is not served
    capsys.readouterr()
    assert fleet_main(["models", "pin", MODEL, bad.version, "--config", str(cfg), "--wait-s", "60"]) == 1  # NOT SERVED
    out = capsys.readouterr()
    doc = json.loads(out.out.strip().splitlines()[-1])
    _show(capsys, f"\npin output: served {doc['served']}; not_served: {doc['not_served']}\nstderr: {out.err.strip()}")
    assert doc["state"]["stable"] == bad.version
    assert doc["served"] == {good.version: sorted([w1.hostname, w2.hostname])}
    assert doc["not_served"] is not None and f"desired stable {bad.version} is not served" in doc["not_served"]
    assert "ChecksumMismatch" in doc["not_served"] and f"fleet: NOT SERVED: desired stable {bad.version}" in out.err
    assert {x.worker for x in refusals(r, MODEL) if x.version == bad.version} == {w1.hostname, w2.hostname}

    # w2 restarts while the corrupted version is pinned: it refuses it and serves 2.0.0, the last served
    w2.stop()
    w2 = fleet.worker(cfg, MODEL, hostname=w2.hostname)
    assert _beat(r, w2.hostname).get("version") == good.version, w2.log_tail(4000)
    log = w2.log_tail(200_000)
    assert f"refuses {MODEL} {bad.version}, at start" in log and "keeps serving its current version" not in log
    assert f"serves {MODEL} {good.version}, the version the fleet last served" in log

    client = fleet.client(cfg)
    ids = [client.submit(MODEL, text=f"after the restart {i}", top_k=1) for i in range(40)]
    results, failures = collect(client, ids)
    by_version = {v: sum(x.version == v for x in results) for v in {x.version for x in results}}
    by_worker = {h: sum(x.timings.worker == h for x in results) for h in (w1.hostname, w2.hostname)}
    _show(capsys, f"after the restart: {len(results)}/{len(ids)} served, by version {by_version}, "
                  f"by worker {by_worker}")
    assert not failures and len(results) == len(ids)
    assert by_version == {good.version: len(ids)}  # one stable version, on both workers
    assert all(x.top_k is not None and abs(x.top_k[0].logprob - good.logprob) < 1e-4 for x in results)

    # fleet status: the desired version is not served; after a pin of the good one, the refusals are superseded
    capsys.readouterr()  # what the test printed so far
    assert fleet_main(["status", "--config", str(cfg)]) == 0
    status = capsys.readouterr().out
    line = next(x for x in status.splitlines() if "NOT SERVED" in x and bad.version in x)
    _show(capsys, f"fleet status: {line.strip()}")
    assert f"desired stable {bad.version} is not served by any worker" in line and good.version in line
    pin(r, MODEL, good.version, "test@served")
    capsys.readouterr()  # what the test printed so far
    assert fleet_main(["status", "--json", "--config", str(cfg)]) == 0
    row = next(m for m in json.loads(capsys.readouterr().out)["models"] if m["model"] == MODEL)
    assert row["not_served"] is None and row["served"] == {good.version: sorted([w1.hostname, w2.hostname])}
    assert row["last_refusals"] and all(x["superseded"] == f"the desired state is now {good.version}"
                                        for x in row["last_refusals"])
    capsys.readouterr()  # what the test printed so far
    assert fleet_main(["status", "--config", str(cfg)]) == 0
    refused_lines = [x for x in capsys.readouterr().out.splitlines() if "REFUSED" in x]
    assert refused_lines and all(f"REFUSED (superseded: the desired state is now {good.version})" in x
                                 for x in refused_lines)


def test_a_worker_falls_back_only_to_the_manifest_the_fleet_served(fleet: Fleet, s3: EmbeddedSeaweed,
                                                                   tmp_path: Path) -> None:  # fmt: skip
    """The served record carries the manifest's sha256, and a worker that falls back to it loads those bytes or
    refuses. Before, the fallback loaded whatever the store held under that version, unchecked, where a pin is
    held to the manifest it recorded."""
    configured, good, bad = (publish(s3, tmp_path, scale) for scale in (1.0, 2.0, 3.0))
    bad_key = f"{MODEL}/{bad.version}/{MODEL}-{bad.version}.onnx"
    s3.client().put_object(Bucket=BUCKET, Key=bad_key, Body=b"not the published model")
    w1 = fleet.worker(lifecycle_config(fleet, s3, configured.version, tmp_path / "cache-1"), MODEL,
                      hostname="w1-digest@test")  # fmt: skip
    r = redis.Redis.from_url(fleet.redis_url)
    pin(r, MODEL, good.version, "test@digest")
    wait_until(lambda: _beat(r, w1.hostname).get("version") == good.version, 60, f"w1 on {good.version}")
    manifest_key = f"{MODEL}/{good.version}/manifest.json"
    original = s3.client().get_object(Bucket=BUCKET, Key=manifest_key)["Body"].read()
    served = wait_until(lambda: next((e for e in read_served(r, MODEL) if e.store_version == good.version), None),
                        30, "the served record of the pinned version")  # fmt: skip
    assert served.manifest_sha256 == manifest_digest(original)

    # the same manifest, other bytes (as a hand edit in the bucket leaves it), then a pin every worker refuses
    s3.client().put_object(Bucket=BUCKET, Key=manifest_key, Body=json.dumps(json.loads(original), indent=4).encode())
    pin(r, MODEL, bad.version, "test@digest")
    wait_until(lambda: any(x.version == bad.version for x in refusals(r, MODEL)), 60, "w1's refusal")

    # a worker that starts now (its own cache: it fetches from the store) refuses the bad pin, then the changed
    # manifest of the version the fleet last served, and serves its configured version
    w2 = fleet.worker(lifecycle_config(fleet, s3, configured.version, tmp_path / "cache-2"), MODEL,
                      hostname="w2-digest@test")  # fmt: skip
    log = w2.log_tail(200_000)
    assert _beat(r, w2.hostname).get("version") == configured.version, log[-4000:]
    assert f"cannot load {MODEL} {good.version}, the version the fleet last served, either" in log, log[-4000:]
    assert manifest_digest(original) in log
