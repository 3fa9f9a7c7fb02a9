"""``fleet demo --versions``: model versions end to end on the embedded store.

After the demo's traffic, on the same private fleet (whose workers were started with the store's
settings): publish demo-lm twice to an embedded SeaweedFS (the configured file as ``1.0.0`` and a
differently seeded build as ``1.1.0``), pin ``1.1.0``, split 50 % to ``1.0.0`` as a canary, roll the
canary back, and undo the pin. After each change it waits for every worker's heartbeat to show the
change applied, submits requests and prints which version computed each (every result names it).
Exit 0 only when each step's results are all of the version(s) in force.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import redis

from producer.client import FleetClient
from producer.routing import STATE_CACHE_S
from protocol.errors import FleetError
from protocol.keys import WORKER_KEY_PREFIX
from protocol.messages import InferenceResult
from protocol.model_state import history, pin, read_state, rollback, set_canary
from protocol.settings import FleetSettings
from store.model_store import open_store
from tools.build_lm import build_causal_lm

__all__ = ["MODEL", "run_versions_tour"]

MODEL = "demo-lm"
STABLE, NEXT = "1.0.0", "1.1.0"
BY = "fleet demo"
PROMPTS = ["Versions are published, pinned, split and rolled back", "Hello", "Canary traffic is sticky by key"]


def _say(msg: str) -> None:
    print(f"[demo] {msg}", file=sys.stderr, flush=True)


def _heartbeats(r: redis.Redis[bytes], hostnames: Sequence[str]) -> list[dict[str, Any]]:
    docs = []
    for raw in r.mget([WORKER_KEY_PREFIX + h for h in hostnames]):
        docs.append(json.loads(raw) if raw else {})
    return docs


def _wait_workers(r: redis.Redis[bytes], hostnames: Sequence[str], ok: Callable[[dict[str, Any]], bool],
                  what: str, timeout_s: float = 60.0) -> None:
    """Until every worker's heartbeat satisfies ``ok`` (they beat every worker.heartbeat_s)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(ok(doc) for doc in _heartbeats(r, hostnames)):
            return
        time.sleep(0.2)
    raise TimeoutError(f"workers did not report {what} within {timeout_s:g} s: {_heartbeats(r, hostnames)}")


def _served(client: FleetClient, n: int, key_prefix: str) -> Counter[str]:
    """Submit ``n`` requests (routing keys ``<key_prefix>-<i>``); count results by ``version/role``.

    Waits out the producer's routing cache first (it reads the split at most once a second), so
    every request is routed by the change just made.
    """
    time.sleep(STATE_CACHE_S)
    ids = [client.submit(MODEL, text=PROMPTS[i % len(PROMPTS)], routing_key=f"{key_prefix}-{i}") for i in range(n)]
    counts: Counter[str] = Counter()
    for result in client.wait(ids, timeout_s=120):
        if isinstance(result, InferenceResult):
            counts[f"{result.version}/{result.role}"] += 1
        else:
            counts[f"failed: {type(result).__name__}" if isinstance(result, FleetError) else "failed"] += 1
    return counts


def run_versions_tour(settings: FleetSettings, hostnames: Sequence[str], workdir: Path, requests: int = 40) -> int:
    """Publish, pin, canary, roll back, unpin; returns 0 when every step served what was in force."""
    store = open_store(settings.store)
    r = redis.Redis.from_url(settings.redis_url)
    configured = settings.model(MODEL).path
    second = build_causal_lm(workdir / "models", name=MODEL, version=NEXT, seed=7)
    for version, path in ((STABLE, configured), (NEXT, second)):
        store.push(path, MODEL, version)
        _say(f"published {MODEL} {version} to {store.location} (sha256 + size of every file in its manifest)")
    client = FleetClient(settings)
    checks: list[tuple[str, bool, Counter[str]]] = []
    try:
        pin(r, MODEL, NEXT, BY, store=store)
        _wait_workers(r, hostnames, lambda d: d.get("version") == NEXT, f"{MODEL} {NEXT} pinned")
        got = _served(client, requests // 2, "pinned")
        checks.append((f"pin {NEXT}", set(got) == {f"{NEXT}/stable"}, got))

        set_canary(r, MODEL, STABLE, 50, BY, store=store)
        _wait_workers(r, hostnames, lambda d: d.get("canary_version") == STABLE, f"canary {STABLE} loaded")
        got = _served(client, requests, "split")
        checks.append((f"canary {STABLE} at 50 %", set(got) == {f"{NEXT}/stable", f"{STABLE}/canary"}, got))

        rollback(r, MODEL, BY, reason="fleet demo: canary step done")
        _wait_workers(r, hostnames, lambda d: d.get("canary_version") is None, "the canary dropped")
        got = _served(client, requests // 2, "rolled-back")
        checks.append(("rollback (canary dropped)", set(got) == {f"{NEXT}/stable"}, got))

        rollback(r, MODEL, BY, reason="fleet demo: back to the configured version")
        _wait_workers(r, hostnames, lambda d: d.get("version") == STABLE, f"{MODEL} back on {STABLE}")
    finally:
        client.close()
    for step, ok, got in checks:
        print(f"versions: {step}: " + ", ".join(f"{k} {v}" for k, v in sorted(got.items())) + ("" if ok else "  ✗"))
    state = read_state(r, MODEL)
    print(f"versions: history of {MODEL}: " + " → ".join(
        f"{e.action} {e.to.stable or 'configured'}" + (f" + canary {e.to.canary}" if e.to.canary else "")
        for e in history(r, MODEL)) + f"; now {state.stable if state and state.stable else 'configured'}")
    return 0 if all(ok for _, ok, _ in checks) else 1
