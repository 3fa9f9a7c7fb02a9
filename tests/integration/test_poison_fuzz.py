"""Fuzz a real worker's queue: raw bytes, JSON, and Celery messages with mutated parts, LPUSHed directly.

The worker must never exit (its process, pid and heartbeat stay the same), and every item must end
one of three ways: completed (SUCCESS), failed with an error (FAILURE/REVOKED result), or
dead-lettered (an entry holding its exact bytes). Hypothesis runs derandomized, so the same
items are sent on every run.
"""

from __future__ import annotations

import base64
import json
import time
from collections import Counter
from typing import Any

import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.deadletter import read_entry
from protocol.keys import DEAD_LETTER_KEY, WORKER_KEY_PREFIX
from tests.integration.fleet_fixtures import Fleet
from tests.queue_items import celery_headers, envelope, good_body, raw

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


def _wait_for_outcomes(r: redis.Redis[bytes], sent: list[bytes], *, deadline_s: float) -> Counter[str]:
    """Each sent item's end: its dead-letter entry (matched by bytes), else its stored result."""
    deadline = time.monotonic() + deadline_s
    while True:
        dead = Counter(read_entry(e).raw_bytes() for e in r.lrange(DEAD_LETTER_KEY, 0, -1))
        outcomes: Counter[str] = Counter()
        pending = []
        for item in sent:
            if dead[item]:
                dead[item] -= 1
                outcomes["dead_lettered"] += 1
                continue
            tid = _task_id(item)
            meta = r.get(f"celery-task-meta-{tid}") if tid else None
            state = json.loads(meta)["status"] if meta else None
            if state in ("FAILURE", "REVOKED"):
                outcomes["failed"] += 1
            elif state == "SUCCESS":
                outcomes["completed"] += 1
            else:  # not yet taken, or STARTED
                pending.append(item)
        if not pending:
            return outcomes
        assert time.monotonic() < deadline, (len(pending), pending[:3], outcomes)
        time.sleep(0.2)
