"""Three API keys as adversaries, fuzzed: random sequences over the keys of every gateway route that submits or
reads a request by ID, plus ``FleetClient`` submits straight to Redis (no key, no owner mark), against one real
gateway, one real demo-lm worker and real Redis (:mod:`gateway.request_owners`).

The ledger kept per example (and :class:`tools.ledger.Ledger` at its end):

* every accepted ID reaches exactly one terminal state, and a terminal view once read never changes;
* a key never observes anything of another key's request: every per-ID route answers it with the body of the
  unknown-ID 404 (the ID swapped), and a resubmit of its ID gets the one documented 409 ("already known",
  whatever the body; never "different body", which would tell the bodies apart);
* a request without an owner mark (``FleetClient``) is every key's, and a resubmit through the gateway leaves it
  without one; a refused submit leaves no marker and no mark behind;
* every stream a key may read ends (its ``final`` or ``error`` event).
"""

from __future__ import annotations

import itertools
import json
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gateway.auth import owner_of
from producer.client import FleetClient
from protocol.errors import IdempotencyConflict
from protocol.keys import OWNER_KEY, REQUEST_KEY, RESULT_KEY
from protocol.settings import load_settings
from tests.integration.ops_fixtures import OpsFleet, ops_models, ops_redis
from tools.ledger import Ledger
from tools.redis_server import EmbeddedRedis

__all__ = ["ops_models", "ops_redis"]

pytestmark = pytest.mark.timeout(300)

KEYS = ("ledger-key-a", "ledger-key-b", "ledger-key-c")
IDLE = "idle-lm"
"""The demo LM under another name that no worker serves: its requests stay queued until cancelled."""
BODIES: tuple[dict[str, Any], ...] = (
    {"model": "demo-lm", "input_ids": [5, 6, 7]},
    {"model": "demo-lm", "input_ids": [8, 9]},
    {"model": "demo-lm", "input_ids": [5, 6], "output": {"kind": "generate", "generation": {"max_new_tokens": 6}}},
    {"model": IDLE, "input_ids": [5, 6, 7]},
    {"model": IDLE, "input_ids": [7], "output": {"kind": "generate", "generation": {"max_new_tokens": 4}}},
)
"""The bodies a submit draws from: one-step and generations, served and never served."""
TERMINAL = ("succeeded", "failed", "cancelled", "expired")
OWNER_LESS = -1
"""The owner of a request ``FleetClient`` queued (no key)."""


@dataclass
class Fuzzed:
    fleet: OpsFleet
    http: list[httpx.Client]
    client: FleetClient
    digests: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory, ops_models: Any, ops_redis: EmbeddedRedis) -> Iterator[Fuzzed]:
    """One gateway with three keys, one demo-lm worker (``idle-lm``: none), a client per key, a FleetClient."""
    fleet = OpsFleet(tmp_path_factory.mktemp("owner-ledger"), ops_models, ops_redis)
    try:
        limits = {"limits": {"max_input_tokens": 64}}
        config = fleet.config(serve=("demo-lm",), models={IDLE: {"path": str(ops_models.lm), **limits}},
                              api={"api_keys": list(KEYS)})  # fmt: skip
        fleet.worker(config, "demo-lm")
        gateway = fleet.gateway(config)
        client = FleetClient(load_settings(config))
        http = [httpx.Client(base_url=gateway.url, headers={"X-API-Key": k}, timeout=60) for k in KEYS]
        try:
            yield Fuzzed(fleet, http, client, [owner_of(k, [x.encode() for x in KEYS]) for k in KEYS])
        finally:
            for h in http:
                h.close()
            client.close()
    finally:
        fleet.close()


# -- the operations -------------------------------------------------------------------------------------------------

_KEY = st.integers(0, len(KEYS) - 1)
_BODY = st.integers(0, len(BODIES) - 1)
_ID = st.one_of(st.just(None), st.integers(0, 15))
"""None: a fresh ID; n: the example's n-th ID (mod how many it has; fresh while it has none)."""
_OPS = st.one_of(
    st.tuples(st.just("submit"), _KEY, _ID, _BODY),
    st.tuples(st.just("batch"), _KEY, st.lists(st.tuples(_ID, _BODY), min_size=1, max_size=3)),
    st.tuples(st.just("grouped"), _KEY, _BODY),
    st.tuples(st.just("completion"), _KEY),
    st.tuples(st.just("client"), _ID, _BODY),
    st.tuples(st.just("get"), _KEY, st.integers(0, 15), st.booleans()),
    st.tuples(st.just("delete"), _KEY, st.integers(0, 15)),
    st.tuples(st.just("stream"), _KEY, st.integers(0, 15)),
)


@dataclass
class Known:
    """What the test knows of one accepted ID."""

    owner: int
    """The key index that submitted it, or :data:`OWNER_LESS`."""
    body: int | None
    """Its body's index in :data:`BODIES` (None: a completion's)."""
    final: dict[str, Any] | None = None
    """Its first terminal view read."""


class Run:
    """One example's sequence against the module fleet: the model of what each key may see, and the checks."""

    examples = itertools.count()

    def __init__(self, fz: Fuzzed) -> None:
        self.fz = fz
        self.n = next(self.examples)
        self.fresh = itertools.count()
        self.known: dict[str, Known] = {}
        self.order: list[str] = []
        self.refused: set[str] = set()

    # -- helpers ------------------------------------------------------------------------------------------------
    def pick(self, ref: int | None) -> str:
        if ref is None or not self.order:
            return f"ledger-{self.n}-{next(self.fresh)}"
        return self.order[ref % len(self.order)]

    def accept(self, rid: str, owner: int, body: int | None) -> None:
        if rid not in self.known:
            self.known[rid] = Known(owner, body)
            self.order.append(rid)

    def visible(self, key: int, rid: str) -> bool:
        return self.known[rid].owner in (key, OWNER_LESS)

    def unknown_like(self, key: int, answer: httpx.Response, rid: str, method: str, path: str,
                     params: dict[str, Any]) -> None:  # fmt: skip
        """``answer`` is the unknown-ID 404, byte for byte but the ID."""
        other = f"never-{self.n}-{next(self.fresh)}"
        unknown = self.fz.http[key].request(method, path.format(other), params=params)
        assert answer.status_code == 404, (method, path, rid, answer.status_code, answer.text)
        assert unknown.status_code == 404, unknown.text
        assert answer.text.replace(rid, other) == unknown.text, (answer.text, unknown.text)

    def seen_view(self, rid: str, view: dict[str, Any]) -> None:
        """A terminal view read by a key allowed to read it: the first one is the request's for good."""
        assert view["request_id"] == rid, view
        if view["status"] not in TERMINAL or self.provisional(rid, view):
            return
        known = self.known[rid]
        if known.final is None:
            known.final = view
        assert view == known.final, (rid, known.final, view)

    def provisional(self, rid: str, view: dict[str, Any]) -> bool:
        """A "cancelled" read from the cancel mark alone of a request a worker serves: a worker that took it before
        the mark ends it with its own outcome once its batch (or generation) has started (producer.results.cancel,
        not an owner matter: left as documented there)."""
        known = self.known[rid]
        served = known.body is None or BODIES[known.body]["model"] != IDLE
        stored = self.fz.fleet.redis.get(RESULT_KEY.format(id=rid))
        return view["status"] == "cancelled" and served and (stored is None or b'"REVOKED"' not in stored)

    def expected_refusal(self, key: int, rid: str, body: int) -> str | None:
        """"taken" (another key's), "body" (own or owner-less, another body), or None (accepted)."""
        known = self.known.get(rid)
        if known is None:
            return None
        if not self.visible(key, rid):
            return "taken"
        return None if known.body == body else "body"

    def check_conflict(self, answer: httpx.Response, rid: str, why: str, field_name: str) -> None:
        assert answer.status_code == 409, (rid, why, answer.status_code, answer.text)
        doc = answer.json()
        assert doc["field"] == field_name, (field_name, doc)
        if why == "taken":  # the same words whatever the body: nothing of the other key's request
            assert "already known;" in doc["message"] and "different body" not in doc["message"], doc
        else:
            assert "different body" in doc["message"], doc

    # -- operations ---------------------------------------------------------------------------------------------
    def submit(self, key: int, ref: int | None, body: int) -> None:
        rid = self.pick(ref)
        why = self.expected_refusal(key, rid, body)
        answer = self.fz.http[key].post("/v1/requests", json={**BODIES[body], "request_id": rid})
        if why is not None:
            self.check_conflict(answer, rid, why, "request_id")
            return
        assert answer.status_code == 202, (rid, answer.text)
        self.accept(rid, key, body)

    def batch(self, key: int, items: list[tuple[int | None, int]]) -> None:
        rids = [self.pick(ref) for ref, _ in items]
        bodies = [body for _, body in items]
        answer = self.fz.http[key].post("/v1/requests:batch", json={"requests": [
            {**BODIES[b], "request_id": rid} for rid, b in zip(rids, bodies, strict=True)]})  # fmt: skip
        first: dict[str, int] = {}
        refusals: list[tuple[int, str]] = []
        for i, (rid, b) in enumerate(zip(rids, bodies, strict=True)):
            j = first.setdefault(rid, i)
            why = "body" if bodies[j] != b else self.expected_refusal(key, rid, b)
            if why is not None:
                refusals.append((i, why))
        if not refusals:
            assert answer.status_code == 202, (rids, answer.text)
            for rid, b in zip(rids, bodies, strict=True):
                self.accept(rid, key, b)
            return
        assert answer.status_code == 409, (rids, refusals, answer.text)
        named = {f"requests[{i}].request_id": why for i, why in refusals}
        field_name = answer.json()["field"]
        assert field_name in named, (field_name, named)
        self.check_conflict(answer, rids[int(field_name.split("[")[1].split("]")[0])], named[field_name], field_name)
        for rid in rids:  # nothing of the batch was queued or marked
            if rid not in self.known:
                self.refused.add(rid)
                assert not self.fz.fleet.redis.exists(REQUEST_KEY.format(id=rid), OWNER_KEY.format(id=rid)), rid

    def grouped(self, key: int, body: int) -> None:
        answer = self.fz.http[key].post("/v1/requests", json=BODIES[body])
        assert answer.status_code == 202, answer.text
        self.accept(answer.json()["request_id"], key, body)

    def completion(self, key: int) -> None:
        answer = self.fz.http[key].post("/v1/completions", json={"model": "demo-lm", "prompt": "Hi", "max_tokens": 2})
        assert answer.status_code == 200, answer.text
        self.accept(answer.headers["X-Request-ID"], key, None)

    def plain(self, ref: int | None, body: int) -> None:
        rid = self.pick(ref)
        known = self.known.get(rid)
        spec = BODIES[body]
        output = spec.get("output", {})
        try:
            self.fz.client.submit(spec["model"], spec["input_ids"], request_id=rid, kind=output.get("kind"),
                                  generation=output.get("generation"))  # fmt: skip
        except IdempotencyConflict:
            assert known is not None and known.body != body, (rid, known, body)
            return
        assert known is None or known.body == body, (rid, known, body)
        self.accept(rid, OWNER_LESS, body)

    def get(self, key: int, ref: int, wait: bool) -> None:
        if not self.order:
            return
        rid = self.order[ref % len(self.order)]
        params = {"wait_s": 0.3} if wait else {}
        answer = self.fz.http[key].get(f"/v1/requests/{rid}", params=params)
        if not self.visible(key, rid):
            self.unknown_like(key, answer, rid, "GET", "/v1/requests/{}", params)
            return
        assert answer.status_code == 200, (rid, answer.text)
        self.seen_view(rid, answer.json())

    def delete(self, key: int, ref: int) -> None:
        if not self.order:
            return
        rid = self.order[ref % len(self.order)]
        answer = self.fz.http[key].delete(f"/v1/requests/{rid}")
        if not self.visible(key, rid):
            self.unknown_like(key, answer, rid, "DELETE", "/v1/requests/{}", {})
            return
        assert answer.status_code in (200, 409), (rid, answer.text)
        if answer.status_code == 200:
            self.seen_view(rid, answer.json())

    def stream(self, key: int, ref: int) -> None:
        if not self.order:
            return
        rid = self.order[ref % len(self.order)]
        known = self.known[rid]
        if not self.visible(key, rid):
            answer = self.fz.http[key].get(f"/v1/requests/{rid}/stream", timeout=15)
            self.unknown_like(key, answer, rid, "GET", "/v1/requests/{}/stream", {})
            return
        if known.body is not None and BODIES[known.body]["model"] == IDLE and known.final is None:
            return  # a stream of a request nobody serves waits for its first token: not one to read to its end
        with self.fz.http[key].stream("GET", f"/v1/requests/{rid}/stream", timeout=15) as events:
            text = events.read().decode()
        assert events.status_code in (200, 409), (rid, events.status_code, text)
        if events.status_code == 200:
            kinds = [json.loads(line[5:]).get("type") for line in text.splitlines() if line.startswith("data:")]
            assert kinds and kinds[-1] in ("final", "error"), (rid, text)

    # -- the end of an example -----------------------------------------------------------------------------------
    def settle(self) -> None:
        """Cancel what nobody serves (by a key allowed to), then check the whole ledger."""
        redis_ = self.fz.fleet.redis
        for rid, known in self.known.items():
            if known.body is not None and BODIES[known.body]["model"] == IDLE:
                key = 0 if known.owner == OWNER_LESS else known.owner
                answer = self.fz.http[key].delete(f"/v1/requests/{rid}")
                assert answer.status_code in (200, 409), (rid, answer.text)
        ledger = Ledger(redis_)
        for rid, known in self.known.items():
            if known.body is None or BODIES[known.body]["model"] != IDLE:  # a cancelled one's end: its cancel mark
                ledger.accepted(rid)
        for rid in self.refused - set(self.known):
            ledger.refused(rid)
        report = ledger.check_settled(30)
        assert report.ok, report.as_dict()
        for rid, known in self.known.items():
            mark = redis_.get(OWNER_KEY.format(id=rid))
            expected = None if known.owner == OWNER_LESS else self.fz.digests[known.owner].encode()
            assert mark == expected, (rid, known.owner, mark)
            for key in range(len(KEYS)):
                answer = self.fz.http[key].get(f"/v1/requests/{rid}")
                if self.visible(key, rid):
                    assert answer.status_code == 200, answer.text
                    self.seen_view(rid, answer.json())
                    assert answer.json()["status"] in TERMINAL, answer.text
                else:
                    self.unknown_like(key, answer, rid, "GET", "/v1/requests/{}", {})


def _run(fz: Fuzzed, ops: list[tuple[Any, ...]]) -> None:
    run = Run(fz)
    for op in ops:
        getattr(run, {"client": "plain"}.get(op[0], op[0]))(*op[1:])
    run.settle()


def test_three_keys_keep_the_ownership_ledger(fuzzed: Fuzzed) -> None:
    @settings(max_examples=12, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(_OPS, min_size=1, max_size=10))
    @example([("submit", 0, None, 0), ("submit", 1, 0, 0), ("submit", 1, 0, 1), ("get", 1, 0, True),
              ("delete", 1, 0), ("stream", 1, 0), ("get", 0, 0, False)])  # fmt: skip
    # a generation cancelled while queued: its stream waited 600 s for a first token that never comes (now a 409)
    @example([("submit", 0, None, 4), ("delete", 0, 0), ("stream", 0, 0)])
    @example([("client", None, 4), ("submit", 2, 0, 0), ("submit", 0, 8, 2), ("delete", 2, 15), ("submit", 2, 14, 2),
              ("stream", 1, 5)])
    @example([("client", None, 2), ("submit", 1, 0, 2), ("stream", 2, 0), ("get", 0, 0, True)])
    @example([("submit", 0, None, 3), ("batch", 1, [(None, 0), (0, 3)]), ("delete", 2, 0), ("get", 0, 0, False)])
    def check(ops: list[tuple[Any, ...]]) -> None:
        _run(fuzzed, ops)

    check()


def test_another_keys_reads_racing_a_submit_see_nothing(fuzzed: Fuzzed) -> None:
    """Key b hammers GET, long-poll GET and DELETE of caller-given IDs while key a submits them (an ID b guessed
    before a used it): b is told each one does not exist, whatever instant its read lands; none of a's requests is
    cancelled by b."""
    a, b = fuzzed.http[0], fuzzed.http[1]
    seen: list[tuple[str, str, int, str]] = []
    for n in range(40):
        rid = f"race-{uuid.uuid4().hex}"
        done = threading.Event()

        def hammer(method: str, params: dict[str, Any], rid: str = rid, done: threading.Event = done) -> None:
            with httpx.Client(base_url=str(b.base_url), headers=dict(b.headers), timeout=60) as mine:
                while not done.is_set():
                    answer = mine.request(method, f"/v1/requests/{rid}", params=params)
                    if answer.status_code != 404:
                        seen.append((rid, method, answer.status_code, answer.text))

        threads = [threading.Thread(target=hammer, args=(m, p)) for m, p in
                   (("DELETE", {}), ("GET", {}), ("GET", {"wait_s": 0.2}), ("DELETE", {}))]  # fmt: skip
        for t in threads:
            t.start()
        answer = a.post("/v1/requests", json={**BODIES[3 if n % 2 else 0], "request_id": rid})
        done.set()
        for t in threads:
            t.join(60)
        assert answer.status_code == 202, answer.text
    assert not seen, seen[:5]
