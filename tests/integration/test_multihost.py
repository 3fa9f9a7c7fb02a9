"""The fleet across hosts: Redis, three worker hosts, the gateway and a client, each its own network namespace.

The hosts share only a private /24 (:mod:`tools.netns`, :mod:`tools.multihost`): redis-server listens
on its host's address alone, so every connection it sees is from another host. Under steady HTTP load
through the gateway, worker host ``w1``'s link is cut while it holds requests (its batch window is
5 s) and restored once they were served elsewhere. Every accepted request must succeed, each result
must equal the one computed alone for its prompt, every request computed twice (the workers' logs)
must have come out the same both times, and every result written more than once (seen on the
channel Celery publishes each stored result to) must be the same each time.

Needs root and iproute2 (skips otherwise, saying why); the CI job runs as root.
"""

from __future__ import annotations

import ast
import json
import re
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import httpx
import pytest

from protocol.keys import WORKER_KEY_PREFIX
from tests.integration.paced_load import PacedLoad, Refused
from tests.integration.result_writes import ResultWrites
from tools.build_identity import build_identity
from tools.multihost import HostFleet
from tools.netns import NetHost, unavailable_reason

WHY_NOT = unavailable_reason()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")

VISIBILITY_S = 3
HOLD_MS = 5000
RATE_PER_S = 20.0
PROMPTS = [[3 + i] * (2 + i % 5) + [10 + 7 * i] for i in range(12)]
_RECEIVED = re.compile(r"Task fleet\.infer\[([0-9a-f]+)\] received")
_SUCCEEDED = re.compile(r"Task fleet\.infer\[([0-9a-f]+)\] succeeded in [0-9.e-]+s: (\{.*\})$", re.MULTILINE)


def _essence(result: dict[str, Any]) -> dict[str, Any]:
    """What a result says, without where and when it was computed (timings) and its ID."""
    return {k: v for k, v in result.items() if k not in ("timings", "request_id")}


class HttpLoad(PacedLoad):
    """POSTs ``RATE_PER_S`` requests a second to the gateway from the client host until :meth:`stop`."""

    def __init__(self, client_host: NetHost, url: str) -> None:
        super().__init__(client_host, len(PROMPTS), RATE_PER_S, "http-load")
        self.url = url
        self._http: httpx.Client | None = None

    def session(self) -> httpx.Client:
        self._http = httpx.Client(base_url=self.url, timeout=10)
        return self._http

    def send(self, n: int) -> str:
        assert self._http is not None
        resp = self._http.post("/v1/requests", json={"model": "identity", "input_ids": PROMPTS[n]})
        if resp.status_code != 202:
            raise Refused(str(resp.status_code))
        rid: str = resp.json()["request_id"]
        return rid


def _results(url: str, ids: list[str], timeout_s: float, poll_s: float = 0.2) -> dict[str, dict[str, Any] | None]:
    """Each request's final view over HTTP (polled until not queued/running or ``timeout_s``); None = none in time."""
    out: dict[str, dict[str, Any] | None] = dict.fromkeys(ids)
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=url, timeout=10) as http:
        pending = list(ids)
        while pending and time.monotonic() < deadline:
            still = []
            for rid in pending:
                view = http.get(f"/v1/requests/{rid}").json()
                if view["status"] in ("queued", "running"):
                    still.append(rid)
                else:
                    out[rid] = view
            pending = still
            if pending:
                time.sleep(poll_s)
    return out


def _received_by(log: Path) -> set[str]:
    return set(_RECEIVED.findall(log.read_text(errors="replace"))) if log.exists() else set()


def _computed(logs: list[Path]) -> dict[str, list[dict[str, Any]]]:
    """Every result the workers computed, by request ID, from their logs (Celery logs each result's repr).

    Celery stores a result only when none is stored yet, so a second computation is seen here, not in Redis.
    """
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for log in logs:
        for rid, text in _SUCCEEDED.findall(log.read_text(errors="replace")):
            out[rid].append(ast.literal_eval(text))
    return out


def test_worker_host_cut_off_under_load_loses_nothing(tmp_path: Path) -> None:
    t0 = time.monotonic()
    model = build_identity(tmp_path / "models")
    with HostFleet(tmp_path, worker_hosts=3) as hf:
        hf.start_redis()
        common = {"visibility_timeout_s": VISIBILITY_S}
        normal = hf.config(model, **common)
        # w1's batch window stays open 5 s (up to 16 requests): the cut, within about a second of its first
        # request, always finds it holding what it took
        holding = hf.config(model, **common, worker={"concurrency": 16}, models={"identity": {"batching": {
            "max_batch_size": 16, "max_wait_ms": HOLD_MS, "close_when_idle": False}}})
        w1_host = hf.worker_hosts[0]
        others = [hf.worker(host, normal) for host in hf.worker_hosts[1:]]
        w1 = hf.worker(w1_host, holding, concurrency=16)
        url = hf.gateway(normal)
        hf.wait_workers(others)
        writes = ResultWrites(hf).start()
        # computed while w1 is still starting, as a rule: one it took would wait its window, then come back
        ref_ids, refs = hf.on_client(_reference_results, url)
        hf.wait_workers([w1])

        def w1_in_flight() -> int:
            raw = hf.ask_redis(lambda r: r.get(WORKER_KEY_PREFIX + w1.hostname))
            return int(json.loads(raw)["in_flight"]) if raw else -1

        w1_log = w1.log_path or tmp_path

        def w1_holds() -> set[str]:
            """Load requests w1 took and has not finished (not the references it may have taken while starting)."""
            return _received_by(w1_log) - set(ref_ids) - set(_computed([w1_log]))

        load = HttpLoad(hf.client_host, url).start()
        hf.wait(lambda: len(w1_holds()) >= 3, 30, "w1 to hold requests")
        w1_host.link(up=False)
        t_cut = time.monotonic()
        held = sorted(w1_holds())
        held_views = hf.on_client(_results, url, held, 10 * VISIBILITY_S + 20)
        served_by = {rid: v["result"]["timings"]["worker"] if v and v["result"] else None
                     for rid, v in held_views.items()}
        held_done_s = time.monotonic() - t_cut
        w1_host.link(up=True)
        n = len(load.accepted)
        hf.wait(lambda: len(load.accepted) >= n + 40, 30, "more load after the link came back")
        load.stop()
        ids = [rid for rid, _ in load.accepted]
        views = hf.on_client(_results, url, ids, 10 * VISIBILITY_S + 30)
        hf.wait(lambda: w1_in_flight() == 0, 30, "w1 to finish what it holds")
        clients = hf.ask_redis(lambda r: r.client_list())
        hosts = Counter(hf.host_of(c["addr"].rsplit(":", 1)[0]) for c in clients)
        writes.stop()

    final = {rid: _essence(v["result"]) for rid, v in views.items() if v is not None and v["status"] == "succeeded"}
    lost = [rid for rid in ids if rid not in final]
    wrong = [rid for rid, n in load.accepted if rid in final and final[rid] != refs[n]]
    twice = {rid: w for rid, w in writes.writes.items() if len(w) > 1}
    differing = [rid for rid, w in twice.items() if any(_essence(x) != _essence(w[0]) for x in w)]
    computed = _computed([w.log_path for w in hf.workers if w.log_path])
    recomputed = {rid: c for rid, c in computed.items() if len(c) > 1}
    unlike = [rid for rid, c in recomputed.items()
              if any(_essence(x) != final.get(rid, _essence(c[0])) for x in c)]  # one another and the stored one
    print(f"\n[multihost] accepted {len(ids)}, refused {dict(load.refused)}, lost {len(lost)}, wrong {len(wrong)}; "
          f"w1 held {len(held)} at the cut, served by {dict(Counter(served_by.values()))}; "
          f"computed twice {len(recomputed)} (differing {len(unlike)}), written twice {len(twice)} (differing "
          f"{len(differing)}); Redis clients by host {dict(hosts)}; cut {t_cut - t0:.1f} s after the start, held "
          f"requests served {held_done_s:.1f} s after the cut, {time.monotonic() - t0:.1f} s in all")
    assert not lost and not wrong, (lost, wrong)
    # the duplicate checks below see every result, or fail here rather than pass on nothing
    assert not set(final) - set(computed), "results missing from the workers' logs (Celery's INFO 'succeeded' line)"
    assert not set(final) - set(writes.writes), "stored results not seen published on celery-task-meta-<id>"
    assert held and all(w not in (None, w1.hostname) for w in served_by.values()), served_by
    assert not differing, {rid: twice[rid] for rid in differing}
    assert not unlike, {rid: recomputed[rid] for rid in unlike}
    assert None not in hosts, hosts  # every Redis client is a lab host: none came over loopback
    assert set(hosts) >= {"w1", "w2", "w3", "gw"}, hosts


def _reference_results(url: str) -> tuple[list[str], list[dict[str, Any]]]:
    """Each prompt's request ID and result, computed alone before the load (submitted one at a time)."""
    ids, refs = [], []
    with httpx.Client(base_url=url, timeout=10) as http:
        for prompt in PROMPTS:
            rid = http.post("/v1/requests", json={"model": "identity", "input_ids": prompt}).json()["request_id"]
            view = _results(url, [rid], 60, poll_s=0.01)[rid]
            assert view is not None and view["status"] == "succeeded", view
            ids.append(rid)
            refs.append(_essence(view["result"]))
    return ids, refs
