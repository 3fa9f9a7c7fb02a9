"""The queue-item checks, as a table: each row breaks one part of a good Celery message."""

from __future__ import annotations

import base64
import copy
import json
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery

from broker.message_check import Accepted, Envelope, Refused, bulk_request_ids, check_message, parse_envelope
from protocol.deadletter import Reason
from tests.queue_items import envelope, good_body, pickle_item, raw

QUEUE = "fleet.demo-lm"
CELERY_BUILTINS = ("celery.chunks", "celery.backend_cleanup", "celery.chord_unlock", "celery.map", "celery.starmap",
                   "celery.group", "celery.chain", "celery.chord", "celery.accumulate")
TASKS = frozenset({"fleet.infer", "fleet.infer_bulk", *CELERY_BUILTINS})  # every worker registers the built-ins
REQUEST = {"model": "demo-lm", "input_ids": [1, 2]}


def good() -> dict[str, Any]:
    return envelope(QUEUE, good_body(REQUEST), task_id="t-1")


def verdict(item: bytes) -> Refused | Envelope:
    env = parse_envelope(item)
    if isinstance(env, Refused):
        return env
    checked = check_message(env, TASKS)
    return checked if isinstance(checked, Refused) else env


def body(value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        doc["body"] = base64.b64encode(value if isinstance(value, bytes) else json.dumps(value).encode()).decode()
    return mutate


def header(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        if value is KeyError:
            del doc["headers"][key]
        else:
            doc["headers"][key] = value
    return mutate


def prop(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        doc["properties"][key] = value
    return mutate


def top(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        doc[key] = value
    return mutate


EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}

REFUSED: list[tuple[str, Callable[[dict[str, Any]], None], Reason, str]] = [
    ("object body", body({"request": REQUEST}), Reason.BAD_BODY, "body"),
    ("three-key object body", body({"a": 1, "b": 2, "c": 3}), Reason.BAD_BODY, "body"),
    ("two-item body", body([[REQUEST], {}]), Reason.BAD_BODY, "body"),
    ("args not a list", body([REQUEST, {}, EMBED]), Reason.BAD_BODY, "body[0]"),
    ("kwargs not an object", body([[REQUEST], [], EMBED]), Reason.BAD_BODY, "body[1]"),
    ("embed null", body([[REQUEST], {}, None]), Reason.BAD_BODY, "body[2]"),
    ("embed unknown key", body([[REQUEST], {}, {"id": "other"}]), Reason.BAD_BODY, "body[2].id"),
    ("callbacks not signatures", body([[REQUEST], {}, {"callbacks": "x"}]), Reason.BAD_BODY, "body[2].callbacks"),
    ("chord not a signature", body([[REQUEST], {}, {"chord": [1]}]), Reason.BAD_BODY, "body[2].chord"),
    # Celery's failure handler raised on these (KeyError('task'), 'Context' object has no attribute
    # 'options') outside the task body: the message was never acked and its worker slot never freed
    ("errbacks unreadable", body([[REQUEST], {}, {"errbacks": [{"x": 1}]}]), Reason.BAD_BODY, "body[2].errbacks"),
    ("chain unreadable", body([[REQUEST], {}, {"chain": [{"x": 1}]}]), Reason.BAD_BODY, "body[2].chain"),
    ("callbacks a signature", body([[REQUEST], {}, {**EMBED, "callbacks": [{"task": "fleet.infer"}]}]),
     Reason.BAD_BODY, "body[2].callbacks"),
    ("errbacks a signature", body([[REQUEST], {}, {**EMBED, "errbacks": [{"task": "fleet.infer", "args": []}]}]),
     Reason.BAD_BODY, "body[2].errbacks"),
    ("chord a signature", body([[REQUEST], {}, {**EMBED, "chord": {"task": "celery.chord_unlock"}}]),
     Reason.BAD_BODY, "body[2].chord"),
    ("chain a string", body([[REQUEST], {}, {**EMBED, "chain": "x"}]), Reason.BAD_BODY, "body[2].chain"),
    ("chord a number", body([[REQUEST], {}, {**EMBED, "chord": 0}]), Reason.BAD_BODY, "body[2].chord"),
    *[(f"built-in {name}", header("task", name), Reason.UNKNOWN_TASK, "headers.task") for name in CELERY_BUILTINS],
    ("body not JSON", body(b"\x00nope"), Reason.BODY_NOT_JSON, "body"),
    ("body empty", top("body", ""), Reason.BODY_NOT_JSON, "body"),
    ("body bad kombu marker", body({"__type__": "decimal", "__value__": "x"}), Reason.BODY_NOT_JSON, "body"),
    ("body deep", body(b"[" * 100_000), Reason.BODY_NOT_JSON, "body"),
    ("body bad base64", top("body", "a"), Reason.BAD_ENCODING, "body"),
    ("body_encoding unknown", prop("body_encoding", "hex"), Reason.BAD_ENCODING, "properties.body_encoding"),
    ("body_encoding BASE64", prop("body_encoding", "BASE64"), Reason.BAD_ENCODING, "properties.body_encoding"),
    ("compressed", header("compression", "application/x-gzip"), Reason.BAD_ENCODING, "headers.compression"),
    ("content-encoding", top("content-encoding", "utf-16"), Reason.BAD_ENCODING, "content-encoding"),
    ("content-type data", top("content-type", "application/data"), Reason.CONTENT_TYPE, "content-type"),
    ("content-type yaml", top("content-type", "application/x-yaml"), Reason.CONTENT_TYPE, "content-type"),
    ("content-type missing", top("content-type", None), Reason.CONTENT_TYPE, "content-type"),
    ("pickle", top("content-type", "application/x-python-serialize"), Reason.PICKLE, "content-type"),
    ("unknown task", header("task", "fleet.nope"), Reason.UNKNOWN_TASK, "headers.task"),
    ("protocol 1", header("task", KeyError), Reason.BAD_HEADERS, "headers.task"),
    ("task not a string", header("task", ["fleet.infer"]), Reason.BAD_HEADERS, "headers.task"),
    ("id missing", header("id", KeyError), Reason.BAD_HEADERS, "headers.id"),
    ("id a number", header("id", 7), Reason.BAD_HEADERS, "headers.id"),
    ("id too long", header("id", "x" * 257), Reason.BAD_HEADERS, "headers.id"),
    ("eta a number", header("eta", 5), Reason.BAD_HEADERS, "headers.eta"),
    ("eta not a time", header("eta", "soon"), Reason.BAD_HEADERS, "headers.eta"),
    ("eta empty", header("eta", ""), Reason.BAD_HEADERS, "headers.eta"),  # Celery raised in the event loop
    ("expires empty", header("expires", ""), Reason.BAD_HEADERS, "headers.expires"),
    ("expires overflows", header("expires", "0001-01-01T00:00:00+14:00"), Reason.BAD_HEADERS, "headers.expires"),
    ("timelimit one item", header("timelimit", [1]), Reason.BAD_HEADERS, "headers.timelimit"),
    ("timelimit negative", header("timelimit", [-1, None]), Reason.BAD_HEADERS, "headers.timelimit"),
    ("retries a string", header("retries", "1"), Reason.BAD_HEADERS, "headers.retries"),
    ("retries a boolean", header("retries", True), Reason.BAD_HEADERS, "headers.retries"),
    ("argsrepr a list", header("argsrepr", []), Reason.BAD_HEADERS, "headers.argsrepr"),
    ("stamps a list", header("stamps", []), Reason.BAD_HEADERS, "headers.stamps"),
    ("stamped_headers of numbers", header("stamped_headers", [1]), Reason.BAD_HEADERS, "headers.stamped_headers"),
    ("ignore_result a string", header("ignore_result", "yes"), Reason.BAD_HEADERS, "headers.ignore_result"),
    # the request ran and its answer was dropped: no result, no dead letter, no trace
    ("ignore_result true", header("ignore_result", True), Reason.BAD_HEADERS, "headers.ignore_result"),
    ("chord in headers", header("chord", {"task": "x"}), Reason.BAD_HEADERS, "headers.chord"),
    ("headers a list", top("headers", []), Reason.NOT_A_MESSAGE, "headers"),
    ("body a number", top("body", 5), Reason.NOT_A_MESSAGE, "body"),
    ("properties null", top("properties", None), Reason.NOT_A_MESSAGE, "properties"),
    ("delivery_tag a list", prop("delivery_tag", ["t"]), Reason.NOT_A_MESSAGE, "properties.delivery_tag"),
    ("delivery_info missing", prop("delivery_info", None), Reason.NOT_A_MESSAGE, "properties.delivery_info"),
    ("routing_key a number", prop("delivery_info", {"exchange": "", "routing_key": 1}), Reason.NOT_A_MESSAGE,
     "properties.delivery_info.routing_key"),
    ("priority infinite", prop("priority", 1e400), Reason.NOT_A_MESSAGE, "properties.priority"),
    ("priority a string", prop("priority", "5"), Reason.NOT_A_MESSAGE, "properties.priority"),
    # JSON's \ud800 escape: a lone surrogate, which no Redis key (its result, its dead letter) can hold
    ("id a lone surrogate", header("id", "sur-\ud800-x"), Reason.BAD_HEADERS, "headers.id"),
]


@pytest.mark.parametrize(("mutate", "reason", "field"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_a_broken_part_is_refused_with_its_field(
    mutate: Callable[[dict[str, Any]], None], reason: Reason, field: str
) -> None:
    doc = good()
    mutate(doc)
    got = verdict(raw(doc))
    assert isinstance(got, Refused), got
    assert (got.reason, got.field) == (reason, field), got
    assert got.detail and got.limit
    if field.startswith(("body", "content", "headers.eta", "headers.timelimit")):
        assert got.task_id == "t-1" and got.task == "fleet.infer"  # the sender gets a FAILURE for it


@pytest.mark.parametrize(
    ("item", "reason"),
    [
        (b"this is not json", Reason.NOT_JSON),
        (b"\xff\xfe", Reason.NOT_JSON),
        (b"[" * 100_000, Reason.NOT_JSON),
        (b'{"__type__": "decimal", "__value__": "x"}', Reason.NOT_JSON),
        (b'{"__type__": "bytes", "__value__": 5}', Reason.NOT_JSON),
        (b"[1, 2]", Reason.NOT_A_MESSAGE),
        (b'{"body": "bm9wZQ==", "headers": {}, "properties": {}}', Reason.NOT_A_MESSAGE),
    ],
)
def test_items_that_are_not_envelopes(item: bytes, reason: Reason) -> None:
    got = parse_envelope(item)
    assert isinstance(got, Refused) and got.reason is reason and got.task_id is None


def test_pickle_is_refused_before_anything_unpickles_it() -> None:
    got = verdict(pickle_item(QUEUE, REQUEST, "p-1"))
    assert isinstance(got, Refused) and got.reason is Reason.PICKLE and got.task_id == "p-1"
    assert "disallowed" in got.detail


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: None,
        header("eta", "2001-02-03T04:05:06"),
        header("expires", "2999-01-01T00:00:00+00:00"),
        header("timelimit", [10, 5.5]),
        header("x-custom", {"any": ["thing"]}),
        header("redelivered", True),
        header("ignore_result", False),
        header("lang", None),
        top("content-encoding", "UTF8"),
        prop("priority", None),
        body([[REQUEST], {}, {}]),
        body([[REQUEST], {}, {"callbacks": [], "errbacks": [], "chain": [], "chord": None}]),
        header("task", "fleet.infer_bulk"),
        body([[{"__type__": "datetime", "__value__": "2001-02-03T04:05:06"}], {"k": 1}, {}]),
    ],
)
def test_good_messages_pass(mutate: Callable[[dict[str, Any]], None]) -> None:
    doc = good()
    mutate(doc)
    got = verdict(raw(doc))
    assert isinstance(got, Envelope), got
    assert got.task_id == "t-1" and got.task == doc["headers"]["task"] and got.payload == json.loads(raw(doc))


def test_utf8_body_encoding_passes() -> None:
    doc = envelope(QUEUE, good_body(REQUEST), task_id="t-1", body_encoding="utf-8")
    assert isinstance(verdict(raw(doc)), Envelope)


def test_redelivered_marks_are_read() -> None:
    doc = good()
    assert isinstance(env := parse_envelope(raw(doc)), Envelope) and not env.redelivered
    doc["properties"]["delivery_info"]["redelivered"] = True
    assert isinstance(env := parse_envelope(raw(doc)), Envelope) and env.redelivered


def test_what_celery_itself_sends_passes() -> None:
    """A message built by Celery's own as_task_v2, wrapped the way kombu's Redis channel wraps it."""
    app = Celery(set_as_current=False)
    msg = app.amqp.as_task_v2("c-1", "fleet.infer", args=[REQUEST], kwargs={"x": 1}, eta=None, expires=60)
    item = envelope(QUEUE, json.dumps(msg.body).encode(), task_id="c-1", headers=copy.deepcopy(msg.headers))
    env = parse_envelope(raw(item))
    assert isinstance(env, Envelope) and env.task_id == "c-1"
    checked = check_message(env, TASKS)
    assert isinstance(checked, Accepted)
    assert checked.body[:2] == [[REQUEST], {"x": 1}]  # decoded once, handed to Celery as its payload
    app.close()


def test_task_names_are_not_checked_without_a_registry() -> None:
    doc = good()
    doc["headers"]["task"] = "anything.at.all"
    env = parse_envelope(raw(doc))
    assert isinstance(env, Envelope) and isinstance(check_message(env, None), Accepted)


def test_a_refused_embed_and_a_built_in_task_are_named_in_the_detail() -> None:
    doc = good()
    body([[REQUEST], {}, {"errbacks": [{"x": 1}]}])(doc)
    got = verdict(raw(doc))
    assert isinstance(got, Refused) and "errbacks" in got.detail and "null or empty" in got.detail
    doc = good()
    header("task", "celery.chunks")(doc)
    got = verdict(raw(doc))
    assert isinstance(got, Refused) and "'celery.chunks'" in got.detail and got.limit == "a fleet.* task"


def test_the_requests_of_a_bulk_item_are_read_for_their_failures() -> None:
    items = [{"request_id": "a"}, {"request_id": "b"}, {"request_id": "a"}, {"request_id": "sur-\ud800"}, {}, 5]
    bulk = raw(envelope("q", json.dumps([[{"requests": items}], {}, {}]).encode(), task="fleet.infer_bulk"))
    assert bulk_request_ids(bulk) == ["a", "b"]  # once each; none a result could not be stored under
    assert bulk_request_ids(raw(envelope("q", good_body({"request_id": "a"})))) == []  # not a bulk message
    assert bulk_request_ids(b"not json") == []
    assert bulk_request_ids(raw(envelope("q", b"[1", task="fleet.infer_bulk"))) == []
