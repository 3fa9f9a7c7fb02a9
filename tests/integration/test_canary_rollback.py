"""Automatic rollback (issue 10, must-show 4): a canary whose model fails at run time, 30 % of the
traffic under load, is rolled back by the workers' guard without a human; the history says why.

The canary version passes the worker's warm-up and fails every real request (a ``Gather`` out of
bounds, ``tests/integration/model_versions.py``); everything runs against a real S3 server.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from pathlib import Path

import redis

from producer.client import FleetClient
from protocol.messages import GenerationParams, InferenceRequest, InferenceResult, OutputSpec
from protocol.model_state import AUTO_ROLLBACKS_KEY, history, promote, read_state, set_canary
from tests.integration.conftest import s3_model_store
from tests.integration.fleet_fixtures import Fleet
from tests.integration.lifecycle_fixtures import (
    BUCKET,
    Load,
    Watch,
    collect,
    lifecycle_config,
    publish,
    send_to_role,
    wait_until,
)
from tests.integration.model_versions import MODEL
from tests.integration.ops_fixtures import scrape
from tools.redis_server import free_port
from tools.seaweed_server import EmbeddedSeaweed

BOUNDS = {"window_s": 10, "min_requests": 10, "max_error_rate": 0.05, "check_interval_s": 0.5}


def test_a_failing_canary_is_rolled_back_automatically_and_stable_keeps_serving(
    fleet: Fleet, s3: EmbeddedSeaweed, tmp_path: Path
) -> None:
    stable, bad = publish(s3, tmp_path, 1.0), publish(s3, tmp_path, 2.0, fail_on_real_input=True)
    port = free_port()
    cfg = lifecycle_config(fleet, s3, stable.version, tmp_path / "cache", worker={"metrics_port": port}, canary=BOUNDS)
    worker = fleet.worker(cfg, MODEL, hostname="w1-canary@test")
    r = redis.Redis.from_url(fleet.redis_url)
    watch = Watch(fleet.redis_url, [worker.hostname])
    client = fleet.client(cfg)
    load = Load(client).start()
    try:
        load.submitted_after(20)
        set_canary(r, MODEL, bad.version, 30, "test@canary")
        started = time.monotonic()
        auto = wait_until(lambda: [h for h in history(r, MODEL) if h.action == "auto-rollback"], 60, "auto-rollback")
        elapsed_s = time.monotonic() - started
        wait_until(lambda: watch.all_serve(stable.version, None), 30, "the worker to drop its canary")
        after = [send_to_role(client, "canary", f"canary queue after rollback {i}") for i in range(10)]
        load.submitted_after(20)
    finally:
        ids = load.stop()
        watch.stop()
    results, failures = collect(client, ids)
    late, late_failures = collect(client, after)
    entry = auto[0]
    state = read_state(r, MODEL)
    figures = (entry.figures or {}).get("canary") or {}
    print(f"\ncanary: auto-rollback {elapsed_s:.1f} s after `canary --weight 30` (window {BOUNDS['window_s']} s, "
          f"min_requests {BOUNDS['min_requests']}); reason: {entry.reason}; figures {entry.figures}; "
          f"submitted {len(ids)}, completed {len(results)} (all on {sorted({x.version for x in results})}), "
          f"failed {len(failures)} (the canary's); canary-queue requests after the rollback: "
          f"{len(late)} completed on {sorted({(x.version, x.role) for x in late})}, {len(late_failures)} failed")
    assert state is not None and state.canary is None and state.canary_weight == 0
    assert entry.by == "auto-rollback" and entry.from_.canary == bad.version and entry.to.canary is None
    assert entry.reason is not None and "error rate" in entry.reason and bad.version in entry.reason
    assert figures["version"] == bad.version and figures["requests"] >= BOUNDS["min_requests"]
    assert figures["error_rate"] > BOUNDS["max_error_rate"]
    assert int(r.get(AUTO_ROLLBACKS_KEY.format(model=MODEL)) or 0) == 1
    assert failures and all("Gather" in f for f in failures)  # only the canary's requests failed
    assert {x.version for x in results} == {stable.version} and len(results) + len(failures) == len(ids)
    assert not late_failures and {(x.version, x.role) for x in late} == {(stable.version, "stable")}

    # metrics carry the version: the canary's failures and the stable version's successes, apart
    w = scrape(f"http://127.0.0.1:{port}/metrics")

    def computed(version: str, role: str, outcome: str) -> float:
        labels = (("model", MODEL), ("outcome", outcome), ("role", role), ("version", version))
        return w.get(("fleet_worker_computed_total", labels), 0.0)

    assert computed(bad.version, "canary", "failed") == len(failures)
    assert computed(bad.version, "canary", "ok") == 0
    assert computed(stable.version, "stable", "ok") >= len(results)
    assert w[("fleet_worker_latency_seconds_count", (("model", MODEL), ("role", "canary"), ("version", bad.version)))] \
        == len(failures)


def _served(client: FleetClient, ids: list[str], version: str, role: str) -> bool:
    """True when one of ``ids`` has a stored result computed by ``version`` in ``role`` (no waiting)."""
    return any(isinstance(x, InferenceResult) and (x.version, x.role) == (version, role)
               for x in client.wait(list(ids), timeout_s=0))


def test_a_good_canary_serves_its_share_then_is_promoted_without_a_failure(
    fleet: Fleet, s3: EmbeddedSeaweed, tmp_path: Path
) -> None:
    stable, good = publish(s3, tmp_path, 1.0), publish(s3, tmp_path, 2.0)
    logprob_of = {stable.version: stable.logprob, good.version: good.logprob}
    cfg = lifecycle_config(fleet, s3, stable.version, tmp_path / "cache", canary=BOUNDS)
    worker = fleet.worker(cfg, MODEL, hostname="w1-promote@test")
    r = redis.Redis.from_url(fleet.redis_url)
    watch = Watch(fleet.redis_url, [worker.hostname])
    client = fleet.client(cfg)
    load = Load(client).start()
    try:
        load.submitted_after(10)
        set_canary(r, MODEL, good.version, 50, "test@promote")
        wait_until(lambda: watch.all_serve(stable.version, good.version), 60, "the worker to load the canary")
        load.submitted_after(40)
        # promote only once both versions have served (a loaded machine can leave the queue behind the load)
        wait_until(lambda: _served(client, load.ids, stable.version, "stable")
                   and _served(client, load.ids, good.version, "canary"), 60, "both versions to serve a request")
        promote(r, MODEL, "test@promote")
        wait_until(lambda: watch.all_serve(good.version, None), 60, "the worker to serve the promoted version")
        load.submitted_after(20)
    finally:
        ids = load.stop()
        watch.stop()
    results, failures = collect(client, ids)
    pairs = dict(Counter((x.version, x.role) for x in results))
    print(f"\npromote: submitted {len(ids)}, completed {len(results)}, failed {len(failures)}; by (version, role) "
          f"{pairs}; auto-rollbacks {[h.action for h in history(r, MODEL)].count('auto-rollback')}")
    assert not failures and len(results) == len(ids)
    assert all(x.top_k is not None and abs(x.top_k[0].logprob - logprob_of[x.version]) < 1e-4 for x in results)
    assert pairs.get((good.version, "canary"), 0) > 0 and pairs.get((stable.version, "stable"), 0) > 0
    assert pairs.get((good.version, "stable"), 0) > 0  # after the promotion
    assert set(pairs) <= {(stable.version, "stable"), (good.version, "canary"), (good.version, "stable")}
    assert [h.action for h in history(r, MODEL)] == ["canary", "promote"]  # the guard let a good canary be
    assert "loaded identity " + good.version in worker.log_tail(200_000)
    assert worker.log_tail(200_000).count("loaded identity " + good.version) == 1  # promoted without a reload


def test_generations_on_the_canary_queue_run_on_the_canary_version(
    fleet: Fleet, s3: EmbeddedSeaweed, model_dir: Path, tmp_path: Path
) -> None:
    onnx_file = model_dir / "demo-lm" / "demo-lm-1.0.0.onnx"
    store = s3_model_store(s3, tmp_path / "push")
    v1, v2 = (f"1.0.0-{uuid.uuid4().hex[:8]}" for _ in range(2))
    for version in (v1, v2):
        store.push(onnx_file, "demo-lm", version)
    cfg = fleet.config(
        store={"backend": "s3", "endpoint_url": s3.endpoint_url, "bucket": BUCKET, "cache_dir": str(tmp_path / "c")},
        models={"demo-lm": {"path": None, "store_version": v1}},
    )
    worker = fleet.worker(cfg, "demo-lm", hostname="w1-gen-canary@test")
    r = redis.Redis.from_url(fleet.redis_url)
    watch = Watch(fleet.redis_url, [worker.hostname])
    set_canary(r, "demo-lm", v2, 10, "test@gen")
    try:
        wait_until(lambda: watch.all_serve(v1, v2), 60, "the worker to load the canary")
    finally:
        watch.stop()
    client = fleet.client(cfg)
    output = OutputSpec(kind="generate", generation=GenerationParams(max_new_tokens=4))
    ids = {role: [client.send(InferenceRequest(model="demo-lm", input_ids=[5, 6, 7 + i], output=output), role=role)
                  for i in range(4)] for role in ("stable", "canary")}
    done = {role: collect(client, rids) for role, rids in ids.items()}
    served = {role: sorted({(x.version, x.role) for x in res}) for role, (res, _) in done.items()}
    print(f"\ngenerations by queue role -> (version, role) that computed them: {served}")
    assert all(not failures and len(res) == 4 for res, failures in done.values())
    assert all(x.generation is not None and len(x.generation.token_ids) == 4 for res, _ in done.values() for x in res)
    assert served == {"stable": [(v1, "stable")], "canary": [(v2, "canary")]}
    tokens = {role: [x.generation.token_ids if x.generation else None for x in res] for role, (res, _) in done.items()}
    assert tokens["stable"] == tokens["canary"]  # the two versions are the same bytes: the same greedy tokens
