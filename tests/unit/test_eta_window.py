"""How far ahead an ETA may be (broker/eta_window.py), the guard's refusal of one too far, and its requeue:
pure, with the time passed in."""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from celery import Celery
from celery.utils.time import maybe_iso8601, maybe_make_aware

from broker.dead_letter_writer import failure_of
from broker.eta_window import ETA_MARGIN_FRACTION, EtaTooFar, eta_too_far, eta_unix_s, item_eta_too_far, max_eta_ahead_s
from broker.message_check import Accepted, Envelope, Refused, check_message, parse_envelope
from producer.deadletter import requeue_refusal
from protocol.deadletter import DEAD_LETTERED, Reason, make_entry, requeue_allowed
from protocol.errors import InvalidRequest
from tests.queue_items import envelope, good_body, raw

NOW = 1_800_000_000.0  # 2027-01-15T08:00:00Z
VISIBILITY_S = 3600
LIMIT_S = 1800.0
QUEUE = "fleet.demo-lm"
REQUEST = {"model": "demo-lm", "input_ids": [1, 2]}


def aware(ahead_s: float, offset_h: int = 0) -> str:
    """An ETA ``ahead_s`` after NOW, written with a UTC offset of ``offset_h`` hours (as ``isoformat`` does)."""
    return datetime.fromtimestamp(NOW + ahead_s, timezone(timedelta(hours=offset_h))).isoformat()


def naive(ahead_s: float) -> str:
    """The same instant without an offset (``datetime.utcnow() + …``): Celery reads a naive ETA as UTC."""
    return datetime.fromtimestamp(NOW + ahead_s, UTC).replace(tzinfo=None).isoformat()


def test_the_limit_is_the_visibility_timeout_less_its_margin() -> None:
    assert ETA_MARGIN_FRACTION == 0.5
    assert max_eta_ahead_s(3600) == LIMIT_S and max_eta_ahead_s(6) == 3.0 and max_eta_ahead_s(5) == 2.5


@pytest.mark.parametrize(
    ("eta", "refused"),
    [
        (None, False),
        (aware(-60), False),  # past: Celery runs it at once
        (aware(0), False),
        (aware(1799), False),  # within
        (aware(LIMIT_S), False),  # at the limit: within
        (aware(LIMIT_S + 0.001), True),  # beyond, by a millisecond
        (aware(1801), True),
        (aware(86_400 * 365), True),
        (naive(1799), False),
        (naive(LIMIT_S), False),
        (naive(1801), True),
        (aware(LIMIT_S, offset_h=2), False),  # the same instant in another zone: the offset is honoured
        (aware(1801, offset_h=-5), True),
        (aware(1799, offset_h=14), False),
        (aware(1801).replace("+00:00", "Z"), True),
        ("", False),  # not a time: the header checks refuse these as bad_headers
        ("soon", False),
        (17, False),
    ],
)
def test_an_eta_is_refused_only_beyond_the_limit(eta: Any, refused: bool) -> None:
    got = eta_too_far(eta, now_unix_s=NOW, visibility_timeout_s=VISIBILITY_S)
    assert (got is not None) is refused, got
    if got is not None:
        assert got.eta == eta and got.limit_s == LIMIT_S and got.ahead_s > LIMIT_S


@pytest.mark.parametrize("eta", [aware(1801), naive(1801), aware(1801, offset_h=9), aware(-7200, offset_h=-3)])
def test_etas_are_read_as_celery_reads_them(eta: str) -> None:
    """``Request.__init__``: ``maybe_make_aware(maybe_iso8601(eta), app.conf.timezone)`` (naive = UTC)."""
    app = Celery(set_as_current=False)
    celery_reads = maybe_make_aware(maybe_iso8601(eta), app.conf.timezone)  # type: ignore[arg-type]
    assert eta_unix_s(eta) == pytest.approx(celery_reads.timestamp(), abs=1e-6)
    app.close()


@pytest.mark.parametrize(("countdown", "refused"), [(60, False), (1800, False), (1801, True), (7200, True)])
def test_what_a_celery_client_writes_for_a_countdown(countdown: int, refused: bool) -> None:
    app = Celery(set_as_current=False)
    msg = app.amqp.as_task_v2("c-1", "fleet.infer", args=[REQUEST], countdown=countdown,
                              now=datetime.fromtimestamp(NOW, UTC))
    assert isinstance(msg.headers["eta"], str)
    assert (eta_too_far(msg.headers["eta"], now_unix_s=NOW, visibility_timeout_s=VISIBILITY_S) is not None) is refused
    naive_eta = datetime.fromtimestamp(NOW + countdown, UTC).replace(tzinfo=None)  # apply_async(eta=utcnow() + …)
    msg = app.amqp.as_task_v2("c-2", "fleet.infer", args=[REQUEST], eta=naive_eta)
    assert (eta_too_far(msg.headers["eta"], now_unix_s=NOW, visibility_timeout_s=VISIBILITY_S) is not None) is refused
    app.close()


def test_the_detail_names_the_field_the_value_and_the_limit() -> None:
    got = eta_too_far(aware(7200), now_unix_s=NOW, visibility_timeout_s=VISIBILITY_S)
    assert isinstance(got, EtaTooFar)
    detail = got.detail()
    assert detail.startswith(f"headers.eta {aware(7200)!r} is 7200 s ahead")
    assert "limit of 1800 s ahead" in detail and "visibility_timeout_s=3600 s" in detail and "twice" in detail
    assert got.in_reach_at_unix_s == NOW + 7200 - LIMIT_S


def _message(eta: Any, body: bytes | None = None) -> Envelope:
    doc = envelope(QUEUE, body if body is not None else good_body(REQUEST), task_id="t-1")
    doc["headers"]["eta"] = eta
    env = parse_envelope(raw(doc))
    assert isinstance(env, Envelope)
    return env


def test_the_guard_refuses_an_eta_beyond_the_limit_and_names_it() -> None:
    got = check_message(_message(aware(1801)), None, now_unix_s=NOW, visibility_timeout_s=VISIBILITY_S)
    assert isinstance(got, Refused)
    assert (got.reason, got.field, got.limit, got.task_id) == (Reason.ETA_BEYOND_VISIBILITY, "headers.eta", "1800",
                                                                "t-1")
    assert aware(1801) in got.detail and "visibility_timeout_s=3600 s" in got.detail
    error = failure_of(got)  # what the request's FAILURE carries
    assert isinstance(error, InvalidRequest) and (error.field, error.limit) == ("headers.eta", 1800.0)
    assert str(error).startswith(f"{DEAD_LETTERED} (eta_beyond_visibility): headers.eta ")


def test_the_guard_takes_an_eta_within_the_limit_and_skips_the_check_without_the_time() -> None:
    assert isinstance(check_message(_message(aware(LIMIT_S)), None, now_unix_s=NOW, visibility_timeout_s=VISIBILITY_S),
                      Accepted)
    assert isinstance(check_message(_message(naive(60)), None, now_unix_s=NOW, visibility_timeout_s=VISIBILITY_S),
                      Accepted)
    assert isinstance(check_message(_message(aware(86_400)), None), Accepted)


def test_a_malformed_message_is_named_for_what_makes_it_so_not_for_its_eta() -> None:
    got = check_message(_message(aware(86_400), body=b"[1, 2]"), None, now_unix_s=NOW,
                        visibility_timeout_s=VISIBILITY_S)
    assert isinstance(got, Refused) and got.reason is Reason.BAD_BODY  # requeued, it would be refused again
    got = check_message(_message(""), None, now_unix_s=NOW, visibility_timeout_s=VISIBILITY_S)
    assert isinstance(got, Refused) and got.reason is Reason.BAD_HEADERS


def _entry(eta: Any, reason: Reason = Reason.ETA_BEYOND_VISIBILITY) -> Any:
    doc = envelope(QUEUE, good_body(REQUEST), task_id="t-1")
    doc["headers"]["eta"] = eta
    return make_entry(raw(doc), reason=reason, detail="why", field="headers.eta", queue=QUEUE, list_key=QUEUE,
                      now_unix_s=NOW, task_id="t-1", task="fleet.infer")


def test_an_eta_entry_requeues_once_its_eta_is_within_reach() -> None:
    entry = _entry(aware(7200))
    assert requeue_allowed(entry.reason, entry.task) is False  # depends on the time: requeue_refusal decides
    why = requeue_refusal(entry, now_unix_s=NOW, visibility_timeout_s=VISIBILITY_S)
    in_reach = datetime.fromtimestamp(NOW + 7200 - LIMIT_S, UTC).isoformat(timespec="seconds")
    assert why is not None and "eta_beyond_visibility" in why and f"until {in_reach}" in why
    assert "visibility_timeout_s=3600 s" in why
    assert requeue_refusal(entry, now_unix_s=NOW + 7200 - LIMIT_S - 1, visibility_timeout_s=VISIBILITY_S) is not None
    assert requeue_refusal(entry, now_unix_s=NOW + 7200 - LIMIT_S, visibility_timeout_s=VISIBILITY_S) is None
    assert requeue_refusal(entry, now_unix_s=NOW + 10_000, visibility_timeout_s=VISIBILITY_S) is None  # past: runs now
    assert requeue_refusal(entry, now_unix_s=NOW, visibility_timeout_s=7200 * 2) is None  # a longer timeout now
    assert requeue_refusal(entry, now_unix_s=NOW + 10_000, visibility_timeout_s=None) is not None  # cannot tell


def test_other_entries_requeue_as_before() -> None:
    assert requeue_refusal(_entry(aware(7200), Reason.MAX_DELIVERIES), now_unix_s=NOW,
                           visibility_timeout_s=VISIBILITY_S) is None
    why = requeue_refusal(_entry(None, Reason.BAD_BODY), now_unix_s=NOW, visibility_timeout_s=VISIBILITY_S)
    assert why is not None and why.endswith("(why); a worker would refuse it again")


def test_an_item_that_cannot_be_read_has_no_eta() -> None:
    assert item_eta_too_far(b"\xff not json", now_unix_s=NOW, visibility_timeout_s=VISIBILITY_S) is None
    assert item_eta_too_far(b"[1]", now_unix_s=NOW, visibility_timeout_s=VISIBILITY_S) is None
    doc = json.loads(raw(envelope(QUEUE, good_body(REQUEST), task_id="t-1")))
    late = copy.deepcopy(doc)
    late["headers"]["eta"] = aware(1801)
    assert item_eta_too_far(json.dumps(late).encode(), now_unix_s=NOW, visibility_timeout_s=VISIBILITY_S) is not None
    assert item_eta_too_far(json.dumps(doc).encode(), now_unix_s=NOW, visibility_timeout_s=VISIBILITY_S) is None
