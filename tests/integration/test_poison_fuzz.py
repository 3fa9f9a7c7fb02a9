"""Fuzz a real worker's queue: raw bytes, JSON, and Celery messages with mutated parts, LPUSHed directly.

The worker must never exit (its process, pid and heartbeat stay the same), and every item must end
one of three ways: completed (SUCCESS), failed with an error (FAILURE/REVOKED result), or
dead-lettered (an entry holding its exact bytes). Hypothesis runs derandomized, so the same
items are sent on every run.

The second test takes what the fleet's producer and a plain Celery client really write and
mutates 5,000 of them per worker concurrency (1 and 8) with a seeded generator, a valid request
after every ten: none may stop or wedge the worker (every valid request is served, nothing stays
unacked) and each mutated item must end dead-lettered or answered under its ID.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import random
import time
from collections import Counter
from typing import Any

import pytest
import redis
from celery import Celery
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.deadletter import Reason, read_entry
from protocol.keys import DEAD_LETTER_KEY, WORKER_KEY_PREFIX
from tests.integration.fleet_fixtures import Fleet
from tests.queue_items import celery_headers, envelope, good_body, raw
from tools.ledger import Ledger

QUEUE = "fleet.demo-lm"
EXAMPLES = 150
DELETE = object()

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
markers = st.builds(
    lambda kind, value: {"__type__": kind, "__value__": value},
    st.sampled_from(["datetime", "date", "time", "decimal", "uuid", "bytes", "base64", "nope"]),
    json_values,
)
anything = json_values | markers

# header values that would park a message (future eta) or hide its result (ignore_result=True) are
# left out: the fuzzer must be able to see every item's end
HEADER_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "eta": st.sampled_from([None, "", "soon", "2001-02-03T04:05:06", "0001-01-01T00:00:00+14:00", 17, [], {}]),
    "expires": st.sampled_from([None, "", "later", "2001-02-03T04:05:06+00:00", "2999-01-01T00:00:00", 3.5, {}]),
    "ignore_result": st.sampled_from([None, False, "yes", 1, []]),
    "id": st.sampled_from([None, "", "x" * 300, 7, [], {"a": 1}]),
    "task": st.sampled_from(["fleet.infer_bulk", "fleet.nope", "", None, 3, ["fleet.infer"]]) | st.text(max_size=10),
    "timelimit": st.sampled_from([None, [None, None], [1, None], [None], "5", [-1, 2], [1e300, None]]) | anything,
}
HEADER_KEYS = [*celery_headers("t", "i"), "compression", "redelivered", "callbacks", "chord", "x-extra"]


@st.composite
def requests_(draw: st.DrawFn) -> Any:
    """A request payload: often valid, sometimes invalid, sometimes anything."""
    return draw(st.one_of(
        st.fixed_dictionaries({"model": st.just("demo-lm"),
                               "input_ids": st.lists(st.integers(-5, 600), min_size=0, max_size=6)}),
        anything,
    ))


@st.composite
def celery_shaped(draw: st.DrawFn) -> dict[str, Any]:
    """A hand-built Celery envelope with zero to three parts replaced, removed or re-encoded."""
    parts: list[Any] = [[draw(requests_())], {}, json.loads(good_body({}))[2]]
    body: bytes | None = None  # set when the body is replaced as a whole
    item = envelope(QUEUE, b"", task_id="PLACEHOLDER")
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 2, 3]))):
        kind = draw(st.sampled_from(["header", "body", "content", "property", "envelope", "args"]))
        if kind == "header":
            key = draw(st.sampled_from(HEADER_KEYS))
            _put(item.get("headers"), key, draw(st.just(DELETE) | HEADER_VALUES.get(key, anything)))
        elif kind == "body":
            body = draw(st.one_of(st.binary(max_size=40), anything.map(lambda v: json.dumps(v).encode())))
        elif kind == "args":
            parts[draw(st.integers(0, 2))] = draw(anything)
        elif kind == "content":
            key = draw(st.sampled_from(["content-type", "content-encoding"]))
            _put(item, key, draw(st.sampled_from([
                "application/json", "application/x-python-serialize", "application/data", "application/text",
                "application/x-yaml", "text/plain", "", None, "utf-8", "UTF8", "binary", "latin-1", 5, DELETE,
            ])))
        elif kind == "property":
            key = draw(st.sampled_from(["delivery_tag", "delivery_info", "priority", "body_encoding", "reply_to"]))
            value = draw(st.just(DELETE) | st.sampled_from(["base64", "utf-8", "BASE64", "hex", "", 300, 9]) | anything)
            _put(item.get("properties"), key, value)
        else:
            key = draw(st.sampled_from(["body", "headers", "properties"]))
            _put(item, key, draw(st.just(DELETE) | anything))
    if item.get("body") == "":  # not replaced by an envelope mutation: encode the (mutated) body
        item["body"] = base64.b64encode(body if body is not None else json.dumps(parts).encode()).decode()
    return item


def _put(doc: Any, key: str, value: Any) -> None:
    if not isinstance(doc, dict):
        return
    if value is DELETE:
        doc.pop(key, None)
    else:
        doc[key] = value


# one item in eight is raw bytes, one in eight any JSON, the rest Celery-shaped
queue_items = st.sampled_from(["bytes", "json", *["celery"] * 6]).flatmap(lambda kind: {
    "bytes": st.binary(max_size=64).map(lambda b: ("bytes", b)),
    "json": anything.map(lambda v: ("json", json.dumps(v).encode())),
    "celery": celery_shaped().map(lambda item: ("celery", item)),
}[kind])


def _task_id(item: bytes) -> str | None:
    try:
        tid = json.loads(item)["headers"]["id"]
    except Exception:
        return None
    return tid if isinstance(tid, str) else None


def test_fuzzed_queue_items_never_stop_the_worker(fleet: Fleet) -> None:
    cfg = fleet.config()
    worker = fleet.worker(cfg)
    r = redis.Redis.from_url(fleet.redis_url)
    beat = json.loads(r.get(WORKER_KEY_PREFIX + worker.hostname) or b"{}")
    sent: list[bytes] = []

    @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(queue_items)
    def push(kind_item: tuple[str, Any]) -> None:
        kind, item = kind_item
        if kind == "celery":
            headers = item.get("headers")
            if isinstance(headers, dict) and headers.get("id") == "PLACEHOLDER":
                headers["id"] = f"fuzz-{len(sent)}"
            item = raw(item)
        sent.append(item)
        r.lpush(QUEUE, item)

    started = time.monotonic()
    push()
    outcomes = _wait_for_outcomes(r, sent, deadline_s=45)
    elapsed = time.monotonic() - started

    assert worker.proc is not None and worker.proc.poll() is None, worker.log_tail()
    now = json.loads(r.get(WORKER_KEY_PREFIX + worker.hostname) or b"{}")
    assert now.get("pid") == beat["pid"] == worker.proc.pid and now.get("ready") is True
    assert now.get("started_unix_s") == beat["started_unix_s"]  # no restart
    assert "Unrecoverable error" not in worker.log_tail(2_000_000)
    assert len(sent) == EXAMPLES
    assert sum(outcomes.values()) == len(sent), outcomes
    assert outcomes["dead_lettered"] and outcomes["completed"] and outcomes["failed"], outcomes
    print(f"\nfuzz: sent {len(sent)}, {dict(outcomes)}, worker restarts 0, {elapsed:.1f} s")


def _wait_for_outcomes(r: redis.Redis[bytes], sent: list[bytes], *, deadline_s: float,
                       settle_s: float = 15.0) -> Counter[str]:
    """Each sent item's end: its dead-letter entry (matched by bytes), else its stored result. The entries
    are read once each (new ones are pushed at the head) and the results in MGETs of the pending items.
    Fails at ``deadline_s``, once the queue and the unacked set stayed empty for ``settle_s`` with items
    still without an end, or once no item found its end for ``4 * settle_s`` (a wedged worker)."""
    deadline = time.monotonic() + deadline_s
    last_pending, changed, settled = -1, time.monotonic(), time.monotonic()
    dead: Counter[bytes] = Counter()
    seen = 0
    pending = list(sent)
    outcomes: Counter[str] = Counter()
    while True:
        still = []
        ids = [_task_id(item) for item in pending]
        # results first: the guard pushes an item's dead letter before it stores its FAILURE, so an item
        # whose FAILURE is read here has its entry read below (it is counted dead-lettered on every run)
        metas = r.mget([f"celery-task-meta-{tid}" for tid in ids if tid]) if any(ids) else []
        # all but the `seen` oldest (at the tail; new ones are pushed at the head), in one command; entries
        # beyond MAX_ENTRIES would be trimmed: runs stay below it
        new = r.lrange(DEAD_LETTER_KEY, 0, -(seen + 1))
        dead.update(read_entry(e).raw_bytes() for e in new)
        seen += len(new)
        states = iter(json.loads(m)["status"] if m else None for m in metas)
        for item, tid in zip(pending, ids, strict=True):
            state = next(states) if tid else None
            if dead[item]:
                dead[item] -= 1
                outcomes["dead_lettered"] += 1
            elif state in ("FAILURE", "REVOKED"):
                outcomes["failed"] += 1
            elif state == "SUCCESS":
                outcomes["completed"] += 1
            else:  # not yet taken, or STARTED
                still.append(item)
        pending = still
        if not pending:
            return outcomes
        now = time.monotonic()
        if len(pending) != last_pending:
            last_pending, changed, settled = len(pending), now, now
        if r.llen(QUEUE) or r.hlen("unacked"):
            settled = now
        # the worker holds nothing and nothing is queued, yet items have no end: they never will
        assert now - settled < settle_s, ("no trace", len(pending), pending[:3], outcomes)
        assert now - changed < 4 * settle_s, ("no progress: wedged", len(pending), r.llen(QUEUE), outcomes)
        assert time.monotonic() < deadline, (len(pending), pending[:3], outcomes)
        time.sleep(0.2)


# -- thousands of envelopes mutated from real ones, valid requests between them ---------------------
# Seeded `random` rather than hypothesis: 5,000 items per run must be built in well under a second.
ENVELOPES = int(os.environ.get("FLEET_FUZZ_ENVELOPES", "5000"))
"""Mutated envelopes per worker concurrency."""
VALID_EVERY = 10
"""One valid request (a re-IDed copy of a real one) after every this many mutated envelopes."""
BUILTIN_TASKS = ["celery.chunks", "celery.backend_cleanup", "celery.chord_unlock", "celery.map", "celery.starmap",
                 "celery.group", "celery.chain", "celery.chord", "celery.accumulate"]
JUNK: list[Any] = [None, True, 0, -1, 2**64, 1.5, "", "x", "fleet.infer", [], [1], {}, {"a": 1}, [[]], [{}],
                   {"__type__": "bytes", "__value__": 5}, {"__type__": "nope", "__value__": "x"}]
SIGNATURES: list[Any] = [[{"x": 1}], [{"task": "fleet.infer"}], [{"task": "celery.backend_cleanup", "args": []}],
                         {"task": "celery.chord_unlock"}, [{"task": "fleet.infer", "options": 5}], ["fleet.infer"],
                         [{"task": "nope", "subtask_type": "chain", "kwargs": {"tasks": 3}}], [None], "x", 3]
PAST_ETA = ["2001-02-03T04:05:06", "2001-02-03T04:05:06+00:00", "1970-01-01T00:00:00Z"]


def _capture_real_envelopes(fleet: Fleet, cfg: Any) -> list[dict[str, Any]]:
    """What the fleet's producer (fleet.infer and fleet.infer_bulk) and a plain Celery client's send_task
    write, taken off the queue before any worker runs."""
    r = redis.Redis.from_url(fleet.redis_url)
    client = fleet.client(cfg)
    client.submit("demo-lm", [5, 6, 7])
    client.submit_bulk("demo-lm", [[1, 2], [3, 4, 5]])
    plain = Celery(broker=fleet.redis_url, backend=fleet.redis_url)
    try:
        plain.send_task("fleet.infer", args=[{"model": "demo-lm", "input_ids": [1, 2]}], queue=QUEUE)
        plain.send_task("fleet.infer", kwargs={"request": {"model": "demo-lm", "input_ids": [9]}}, queue=QUEUE,
                        expires=3600, time_limit=60, soft_time_limit=50, priority=0)
    finally:
        plain.close()
    items = [json.loads(raw_item) for raw_item in r.lrange(QUEUE, 0, -1)]
    r.delete(QUEUE)
    assert {doc["headers"]["task"] for doc in items} == {"fleet.infer", "fleet.infer_bulk"} and len(items) == 4
    return items


def _body(doc: dict[str, Any]) -> Any:
    return json.loads(base64.b64decode(doc["body"]))


def _set_body(doc: dict[str, Any], body: Any) -> None:
    doc["body"] = base64.b64encode(body if isinstance(body, bytes) else json.dumps(body).encode()).decode()


def _reid(doc: dict[str, Any], task_id: str) -> dict[str, Any]:
    """A copy of ``doc`` under a new task ID (and its own delivery tag), as a producer would send it."""
    doc = copy.deepcopy(doc)
    doc["headers"].update(id=task_id, root_id=task_id)
    doc["properties"].update(correlation_id=task_id, delivery_tag=f"tag-{task_id}")
    body = _body(doc)
    for request in [*body[0], *body[1].values()]:  # the bulk message's own request IDs are made unique too
        for sub in request.get("requests", []) if isinstance(request, dict) else []:
            sub["request_id"] = f"{task_id}-{sub.get('request_id')}"
    _set_body(doc, body)
    return doc


def _mutate_embed(rng: random.Random, doc: dict[str, Any], body: Any, task_id: str) -> None:
    if isinstance(body, list) and len(body) == 3 and isinstance(body[2], dict):
        key = rng.choice(["callbacks", "errbacks", "chain", "chord", "group", "id", "options"])
        if rng.random() < 0.15:
            body[2].pop(key, None)
        else:
            body[2][key] = rng.choice(SIGNATURES + JUNK)
        _set_body(doc, body)


def _mutate_header(rng: random.Random, doc: dict[str, Any], body: Any, task_id: str) -> None:
    headers = doc.get("headers")
    if not isinstance(headers, dict):
        return
    key = rng.choice(["id", "eta", "expires", "timelimit", "retries", "ignore_result", "group", "group_index",
                      "root_id", "parent_id", "argsrepr", "stamps", "stamped_headers", "shadow", "lang",
                      "replaced_task_nesting", "compression", "callbacks", "errbacks", "chord", "x-extra"])
    if key == "id":  # a usable ID stays unique, so an answer under it is this item's
        value: Any = rng.choice([None, 7, [], {}, "", "y" * 300, f"{task_id}-alt"])
    else:
        value = rng.choice([*JUNK, *PAST_ETA] if key in ("eta", "expires") else JUNK)
    if rng.random() < 0.2:
        headers.pop(key, None)
    else:
        headers[key] = value


def _mutate_task(rng: random.Random, doc: dict[str, Any], body: Any, task_id: str) -> None:
    if isinstance(doc.get("headers"), dict):
        doc["headers"]["task"] = rng.choice([*BUILTIN_TASKS, "fleet.infer_bulk", "fleet.infer", "fleet.nope", "", 7,
                                             None, ["fleet.infer"], "celery.nope"])


def _mutate_body(rng: random.Random, doc: dict[str, Any], body: Any, task_id: str) -> None:
    shapes: list[Any] = [
        {"request": 1}, [], [[]], [[], {}], [[], {}, {}, {}], [None, {}, {}], [[], [], {}], [[], {}, None],
        [[{"model": "demo-lm", "input_ids": [1]}], {"request": {}}, {}], [[1, 2], {}, {}],
        [[{"model": "demo-lm", "input_ids": rng.choice([[], [-1], [10**6], ["a"], [1] * 500])}], {}, {}],
        [[{"requests": rng.choice([[], [{}], 5, [{"model": "demo-lm", "input_ids": [1]}]])}], {}, {}],
        [[rng.choice(JUNK)], {}, {"callbacks": None}],
    ]
    _set_body(doc, rng.choice([*shapes, b"\x00\xff", b"[", b"", b'{"__type__": "decimal", "__value__": "x"}']))


def _mutate_encoding(rng: random.Random, doc: dict[str, Any], body: Any, task_id: str) -> None:
    props = doc.get("properties")
    target, key = rng.choice([(doc, "content-type"), (doc, "content-encoding"), (props, "body_encoding")])
    if isinstance(target, dict):
        target[key] = rng.choice(["application/json", "application/x-python-serialize", "application/data",
                                  "text/plain", "", None, "utf-8", "UTF8", "binary", "latin-1", "base64", "BASE64",
                                  "hex", 5])
    if key == "body_encoding" and rng.random() < 0.5 and isinstance(body, list):
        doc["body"] = json.dumps(body)  # the body as text (what body_encoding utf-8 means)


def _mutate_property(rng: random.Random, doc: dict[str, Any], body: Any, task_id: str) -> None:
    if isinstance(doc.get("properties"), dict):
        doc["properties"][rng.choice(["delivery_tag", "delivery_info", "priority", "reply_to", "correlation_id"])] = (
            rng.choice(JUNK))


def _mutate_envelope(rng: random.Random, doc: dict[str, Any], body: Any, task_id: str) -> None:
    doc[rng.choice(["body", "headers", "properties"])] = rng.choice(JUNK)


MUTATIONS = [_mutate_embed, _mutate_embed, _mutate_header, _mutate_task, _mutate_task, _mutate_body, _mutate_body,
             _mutate_encoding, _mutate_property, _mutate_envelope]


def _mutate(rng: random.Random, doc: dict[str, Any], task_id: str) -> bytes:
    """One to three mutations of a real envelope (its embed, headers, task name, body shape, encodings), or
    its bytes cut short or trailed by a byte that is not UTF-8."""
    if rng.random() < 0.04:
        text = raw(doc)
        cut = int(rng.random() * len(text))  # one draw whatever the length: the same items on every run
        return text[:cut] if rng.random() < 0.5 else text + b"\xff"
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        try:
            body = _body(doc)
        except Exception:
            body = None
        rng.choice(MUTATIONS)(rng, doc, body, task_id)
    return raw(doc)


@pytest.mark.parametrize("concurrency", [1, 8])
def test_thousands_of_mutated_envelopes_never_stop_or_wedge_the_worker(fleet: Fleet, concurrency: int) -> None:
    """ENVELOPES envelopes mutated from real ones, a valid request after every VALID_EVERY: the worker never
    exits or wedges (every valid request is served), and every mutated item ends dead-lettered (its exact
    bytes) or answered under its ID; the counts per outcome are printed for docs/reliability.md."""
    cfg = fleet.config(worker={"concurrency": concurrency},
                       models={"demo-lm": {"batching": {"max_batch_size": concurrency}}})
    real = _capture_real_envelopes(fleet, cfg)
    worker = fleet.worker(cfg, concurrency=concurrency)
    r = redis.Redis.from_url(fleet.redis_url)
    beat = json.loads(r.get(WORKER_KEY_PREFIX + worker.hostname) or b"{}")
    rng = random.Random(f"fuzz-{concurrency}")
    mutated: list[bytes] = []
    valid: list[str] = []
    started = time.monotonic()
    with r.pipeline(transaction=False) as pipe:
        for n in range(ENVELOPES):
            task_id = f"fz{concurrency}-{n}"
            mutated.append(_mutate(rng, _reid(rng.choice(real), task_id), task_id))
            pipe.lpush(QUEUE, mutated[-1])
            if n % VALID_EVERY == VALID_EVERY - 1:
                valid.append(f"ok{concurrency}-{n}")
                pipe.lpush(QUEUE, raw(_reid(rng.choice(real), valid[-1])))
            if len(pipe) >= 500:
                pipe.execute()
        pipe.execute()

    outcomes = _wait_for_outcomes(r, mutated, deadline_s=240)
    served = [json.loads(m)["status"] if m else None for m in r.mget([f"celery-task-meta-{t}" for t in valid])]
    elapsed = time.monotonic() - started

    assert served.count("SUCCESS") == len(valid), Counter(served)  # no wedge: every valid request was served
    assert worker.proc is not None and worker.proc.poll() is None, worker.log_tail()
    now = json.loads(r.get(WORKER_KEY_PREFIX + worker.hostname) or b"{}")
    assert now.get("pid") == beat["pid"] and now.get("started_unix_s") == beat["started_unix_s"]  # no restart
    assert now.get("ready") is True, now
    assert "Unrecoverable error" not in worker.log_tail(20_000_000)
    deadline = time.monotonic() + 30
    while r.hlen("unacked") or r.llen(QUEUE):  # every message acked: no slot held
        assert time.monotonic() < deadline, (r.hlen("unacked"), r.llen(QUEUE))
        time.sleep(0.1)
    ledger = Ledger(r, queues=[QUEUE])  # the valid requests by the fleet's ledger: terminal, nothing held
    for rid in valid:
        ledger.accepted(rid)
    ledger.check_settled(30).raise_if_broken()
    assert sum(outcomes.values()) == len(mutated) == ENVELOPES, outcomes
    assert outcomes["dead_lettered"] and outcomes["failed"], outcomes
    assert outcomes["dead_lettered"] == r.llen(DEAD_LETTER_KEY)  # one entry per refused item, none twice
    entries = [read_entry(e) for e in r.lrange(DEAD_LETTER_KEY, 0, -1)]
    reasons = Counter(e.reason.value for e in entries)
    embeds = sum(1 for e in entries if (e.field or "").startswith("body[2]."))
    assert not reasons[Reason.WORKER_ERROR.value], entries  # each refused by the checks, none by the last resort
    builtins = Counter(e.task for e in entries if e.reason is Reason.UNKNOWN_TASK and str(e.task).startswith("celery."))
    print(f"\nfuzz c={concurrency}: {ENVELOPES} mutated envelopes {dict(outcomes)}, {len(valid)} valid requests "
          f"served {served.count('SUCCESS')}, worker exits 0, {elapsed:.1f} s; dead letters by reason "
          f"{dict(reasons.most_common())}; embed fields refused {embeds}; Celery built-in tasks refused "
          f"{sum(builtins.values())} ({len(builtins)} names); worker_error: "
          f"{[(e.task_id, e.detail[:120]) for e in entries if e.reason.value == 'worker_error']}")
