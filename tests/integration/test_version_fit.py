"""A version whose card does not fit its model (another kind, vocab_size, KV layout) never serves it.

The outside tester's case, on a real Redis, a real local-directory store and real worker processes:
the demo encoder pushed as ``demo-lm 2.0.0``. The worker refuses it at load (a canary or a pin set
without the check: recorded as a refusal, stable keeps answering next-token requests), and
``fleet models canary|pin|promote`` refuse it with exit 2 and one line; ``push`` warns.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import redis

from protocol.keys import WORKER_KEY_PREFIX
from protocol.messages import InferenceRequest, InferenceResult
from protocol.model_state import pin, read_state, refusals, set_canary
from store import ModelStore
from store.local import LocalBackend
from tests.integration.fleet_fixtures import Fleet
from tests.integration.lifecycle_fixtures import collect, wait_until
from tests.integration.test_models_cli import fleet_json

MODEL = "demo-lm"
KIND_LINE = (f"fleet: {MODEL} 2.0.0 is an encoder model (embeddings); {MODEL} is a causal_lm: a version must have "
             "its model's kind, vocab_size")


def _store_config(fleet: Fleet, tmp_path: Path, **demo_lm: Any) -> Path:
    store = {"backend": "local", "root": str(tmp_path / "store"), "cache_dir": str(tmp_path / "cache")}
    return fleet.config(store=store, models={MODEL: demo_lm} if demo_lm else {})


def _push_versions(model_dir: Path, tmp_path: Path) -> ModelStore:
    """demo-lm 1.0.0 and 1.1.0 (the configured bytes), 2.0.0 (the demo encoder), 3.0.0 (the Llama: 2 KV heads)."""
    store = ModelStore(LocalBackend(tmp_path / "store"), tmp_path / "push-cache")
    for version, name in (("1.0.0", "demo-lm"), ("1.1.0", "demo-lm"), ("2.0.0", "demo-encoder"),
                          ("3.0.0", "demo-llama")):
        store.push(model_dir / name / f"{name}-1.0.0.onnx", MODEL, version)
    return store


def test_a_worker_refuses_a_canary_and_a_pin_of_another_kind_and_keeps_serving_next_tokens(
    fleet: Fleet, model_dir: Path, tmp_path: Path
) -> None:
    _push_versions(model_dir, tmp_path)
    cfg = _store_config(fleet, tmp_path)  # demo-lm configured from its file, as in the tester's run
    worker = fleet.worker(cfg, MODEL, hostname="w1-fit@test")
    client = fleet.client(cfg)
    r = redis.Redis.from_url(fleet.redis_url)

    def refused(version: str, since: int) -> list[Any]:
        return [x for x in refusals(r, MODEL)[since:] if x.version == version]

    # a canary set without the check (an older CLI, one without the store settings): refused at load
    set_canary(r, MODEL, "2.0.0", 50, "test@fit")
    got = wait_until(lambda: refused("2.0.0", 0), 60, "the worker to refuse the encoder canary")
    assert got[0].worker == worker.hostname and got[0].error_type == "IncompatibleVersion"
    assert got[0].error.startswith(f"{MODEL} 2.0.0 is an encoder model (embeddings); {MODEL} is a causal_lm")

    def beat() -> dict[str, Any]:
        doc: dict[str, Any] = json.loads(r.get(WORKER_KEY_PREFIX + worker.hostname) or b"{}")
        return doc

    wait_until(lambda: (beat().get("last_refusal") or {}).get("version") == "2.0.0", 10, "the refusal in a heartbeat")
    assert beat().get("canary_version") is None and beat().get("version") == "1.0.0"
    ids = [client.send(InferenceRequest(model=MODEL, input_ids=[5, 6, 7 + i]), role=role)
           for i in range(6) for role in ("canary", "stable")]
    results, failures = collect(client, ids)
    assert not failures and len(results) == len(ids)
    assert {(x.version, x.role, x.kind) for x in results} == {("1.0.0", "stable", "next_token")}
    assert all(x.top_k and x.embedding is None for x in results)

    # pinned: refused too; the configured version keeps serving every next-token request
    before = len(refusals(r, MODEL))
    pin(r, MODEL, "2.0.0", "test@fit")
    wait_until(lambda: refused("2.0.0", before), 60, "the worker to refuse the encoder pin")
    results, failures = collect(client, [client.submit(MODEL, [5, 6, 7 + i], top_k=1) for i in range(6)])
    assert not failures and {(x.version, x.kind) for x in results} == {("1.0.0", "next_token")}
    assert all(isinstance(x, InferenceResult) and x.top_k for x in results)
    assert "refuses demo-lm 2.0.0" in worker.log_tail(200_000)
    assert "loaded demo-lm 2.0.0" not in worker.log_tail(200_000)


def test_canary_pin_and_promote_refuse_a_version_that_does_not_fit_with_exit_2(
    fleet: Fleet, model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _push_versions(model_dir, tmp_path)
    r = redis.Redis.from_url(fleet.redis_url)
    for cfg in (_store_config(fleet, tmp_path),  # the model's card: its configured file
                _store_config(fleet, tmp_path, path=None, store_version="1.0.0")):  # the store's 1.0.0
        r.flushall()
        code, doc, err = fleet_json(capsys, cfg, "canary", MODEL, "2.0.0", "--weight", "50")
        assert code == 2 and err.startswith(KIND_LINE) and err.count("\n") == 1, err
        assert doc["type"] == "IncompatibleVersion" and (doc["field"], doc["limit"]) == ("kind", "causal_lm")
        code, _, err = fleet_json(capsys, cfg, "pin", MODEL, "2.0.0", "--wait-s", "0")
        assert code == 2 and err.startswith(KIND_LINE), err
        code, _, err = fleet_json(capsys, cfg, "pin", MODEL, "3.0.0", "--wait-s", "0")
        assert code == 2 and err.startswith(f"fleet: {MODEL} 3.0.0 does not fit {MODEL}: kv_heads 2 (the model's: 4)")
        assert read_state(r, MODEL) is None  # nothing changed

        assert fleet_json(capsys, cfg, "canary", MODEL, "1.1.0", "--weight", "10")[0] == 0  # a version that fits
        # a canary set before the check (or without it): promote refuses to make it stable
        set_canary(r, MODEL, "2.0.0", 10, "test@fit")
        code, _, err = fleet_json(capsys, cfg, "promote", MODEL)
        assert code == 2 and err.startswith(KIND_LINE), err
        state = read_state(r, MODEL)
        assert state is not None and (state.stable, state.canary) == (None, "2.0.0")
        assert fleet_json(capsys, cfg, "rollback", MODEL)[0] == 0


def test_push_warns_when_the_name_is_a_configured_model_of_another_kind(
    fleet: Fleet, model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = _store_config(fleet, tmp_path)
    encoder = str(model_dir / "demo-encoder" / "demo-encoder-1.0.0.onnx")
    code, doc, err = fleet_json(capsys, cfg, "push", encoder, "--name", MODEL, "--version", "2.0.0")
    assert code == 0 and doc["published"] and doc["kind"] == "encoder"  # published: the store is shared
    assert err.startswith(f"fleet: warning: published, but {MODEL} 2.0.0 is an encoder model (embeddings); "
                          f"{MODEL} is a causal_lm") and err.count("\n") == 1, err
    lm = str(model_dir / "demo-lm" / "demo-lm-1.0.0.onnx")
    assert fleet_json(capsys, cfg, "push", lm, "--name", MODEL, "--version", "2.1.0")[2] == ""  # fits: no warning
    assert fleet_json(capsys, cfg, "push", encoder, "--name", "encoder-2", "--version", "1.0.0")[2] == ""  # unknown


def test_without_a_store_only_the_configured_version_can_be_pinned_or_canaried(
    fleet: Fleet, capsys: pytest.CaptureFixture[str]
) -> None:
    """A worker without a model store can load only its configured file: a pin or a canary of another
    version was recorded (exit 0) and then refused by every worker (NOT SERVED, on stderr only)."""
    cfg = fleet.config()
    for argv in (["pin", MODEL, "9.9.9"], ["canary", MODEL, "9.9.10", "--weight", "10"]):
        code, _, err = fleet_json(capsys, cfg, *argv)
        assert code == 2 and "no model store is configured" in err and "configured version 1.0.0" in err, err
    assert read_state(redis.Redis.from_url(fleet.redis_url), MODEL) is None  # nothing was recorded
    code, doc, _ = fleet_json(capsys, cfg, "pin", MODEL, "1.0.0", "--wait-s", "0")  # the configured one: allowed
    assert code == 0 and doc["state"]["stable"] == "1.0.0", doc
