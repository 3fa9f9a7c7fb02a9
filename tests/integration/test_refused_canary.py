"""A canary replaced by one every worker refuses: the replaced canary stops serving, and everything that
reports on the canary (the workers' log, ``fleet status``, the automatic rollback) names the version that
really computed the canary queue's requests.

Two real workers follow versions published to a real S3 server (SeaweedFS); the new canary is corrupted
in the store, so every worker refuses it (ChecksumMismatch).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import redis

from producer.model_status import model_states
from protocol.keys import WORKER_KEY_PREFIX
from protocol.model_state import history, refusals, set_canary
from protocol.settings import load_settings
from tests.integration.fleet_fixtures import Fleet
from tests.integration.lifecycle_fixtures import (
    BUCKET,
    Watch,
    collect,
    lifecycle_config,
    publish,
    send_to_role,
    wait_until,
)
from tests.integration.model_versions import MODEL
from tools.seaweed_server import EmbeddedSeaweed

BOUNDS = {"window_s": 60, "min_requests": 10, "max_error_rate": 0.05, "check_interval_s": 0.5}


def test_a_refused_canary_replaces_the_old_one_and_the_reports_name_what_served(
    fleet: Fleet, s3: EmbeddedSeaweed, tmp_path: Path
) -> None:
    stable, old, bad = (publish(s3, tmp_path, scale) for scale in (1.0, 2.0, 3.0))
    key = f"{MODEL}/{bad.version}/{MODEL}-{bad.version}.onnx"
    original = s3.client().get_object(Bucket=BUCKET, Key=key)["Body"].read()
    s3.client().put_object(Bucket=BUCKET, Key=key, Body=original[:-8] + b"tampered")
    cfg = lifecycle_config(fleet, s3, stable.version, tmp_path / "cache", canary=BOUNDS)
    workers = [fleet.worker(cfg, MODEL, hostname=f"w{i}-refused-canary@test") for i in (1, 2)]
    hosts = sorted(w.hostname for w in workers)
    r = redis.Redis.from_url(fleet.redis_url)
    client = fleet.client(cfg)

    set_canary(r, MODEL, old.version, 30, "test@canary")
    watch = Watch(fleet.redis_url, hosts)
    try:
        wait_until(lambda: watch.all_serve(stable.version, old.version), 60, f"both workers on canary {old.version}")
    finally:
        watch.stop()

    set_canary(r, MODEL, bad.version, 30, "test@canary")
    wait_until(lambda: {x.worker for x in refusals(r, MODEL) if x.version == bad.version} == set(hosts), 60,
               f"both workers to refuse {bad.version}")
    beats = {h: json.loads(r.get(WORKER_KEY_PREFIX + h) or b"{}") for h in hosts}
    assert {h: (b.get("version"), b.get("canary_version")) for h, b in beats.items()} == \
        {h: (stable.version, None) for h in hosts}  # the replaced canary left the slot
    for w in workers:
        assert f"refuses {MODEL} {bad.version}, its canary queue runs on {stable.version}" in w.log_tail(200_000)

    row = next(m for m in model_states(load_settings(cfg), r) if m["model"] == MODEL)
    print(f"\nfleet status not_served: {row['not_served']}")
    assert row["not_served"] is not None
    assert f"canary {bad.version} is not loaded by {', '.join(hosts)} (their canary queue runs on stable " \
           f"{stable.version}); refused by" in row["not_served"]

    ids = [send_to_role(client, "canary", f"canary queue {i}") for i in range(BOUNDS["min_requests"] + 5)]
    results, failures = collect(client, ids)
    served = Counter((x.version, x.role) for x in results)
    assert not failures and served == {(stable.version, "stable"): len(ids)}, served
    assert all(x.top_k is not None and abs(x.top_k[0].logprob - stable.logprob) < 1e-4 for x in results)

    entry = wait_until(lambda: next((h for h in history(r, MODEL) if h.action == "auto-rollback"), None), 60,
                       "the guard to roll the unserved canary back")
    print(f"auto-rollback: {entry.reason}; figures {entry.figures}")
    assert entry.reason is not None and f"canary {bad.version} was refused by 2 worker(s)" in entry.reason
    assert f"(computed by stable {stable.version}: " in entry.reason and "stable served them" not in entry.reason
    figures = entry.figures or {}
    assert figures["stable"]["version"] == stable.version
    assert [f["version"] for f in figures["canary_queue"]] == [stable.version]
    assert figures["canary_queue"][0]["requests"] >= BOUNDS["min_requests"]
