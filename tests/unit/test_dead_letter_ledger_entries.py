"""Dead-letter entries as ``fleet dead-letter`` reads them, whatever the list holds; its flags and its answer when
Redis is down. No Redis: the entries are pure logic, and a Redis nobody listens on answers the last case."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from producer.cli import build_parser
from producer.cli import main as fleet_main
from producer.deadletter import fresh_delivery, requeue_refusal
from protocol.deadletter import Reason, decode_entry, encode_entry, make_entry, read_entry
from protocol.errors import DecodeError

DOWN = "redis://127.0.0.1:1/0"
"""A Redis nobody listens on."""

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12,
)
_entry_shaped = st.fixed_dictionaries({
    "schema_version": st.just(1), "id": st.text(min_size=1, max_size=12),
    "reason": st.sampled_from([r.value for r in Reason]), "detail": st.text(max_size=30), "queue": st.text(max_size=12),
    "list_key": st.text(max_size=12), "dead_lettered_at_unix_s": st.floats(allow_nan=False, allow_infinity=False),
    "raw": st.text(max_size=40), "raw_encoding": st.sampled_from(["utf-8", "base64"]),
})  # fmt: skip
"""Items a hand or another program may have written with an entry's shape: a ``raw`` that is not base64."""
list_items = st.one_of(
    st.binary(max_size=200),
    _json.map(lambda v: json.dumps(v).encode()),
    _entry_shaped.map(lambda v: json.dumps(v).encode()),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(list_items)
def test_whatever_the_list_holds_reads_as_an_entry_whose_message_can_be_read_back(item: bytes) -> None:
    """``list``, ``show`` and ``requeue`` read each item with :func:`read_entry` and then its message: an item with an
    entry's shape whose base64 ``raw`` does not decode (``"0008u"``, ``"\\u0080"``) made ``requeue`` and ``show`` fail
    with ``unexpected Error`` (binascii.Error, ValueError); it is now a ``legacy`` entry."""
    try:
        decode_entry(item)
        legacy = False
    except DecodeError:
        legacy = True
    entry = read_entry(item)
    json.dumps({**entry.summary(), **entry.model_dump(mode="json")})
    message = entry.raw_bytes()
    if legacy:
        assert message == item and entry.reason is Reason.LEGACY and entry.id.startswith("legacy-")
    fresh_delivery(message)
    requeue_refusal(entry, now_unix_s=1_700_000_000.0, visibility_timeout_s=3600)


@pytest.mark.parametrize(("raw", "encoding"), [("0008u", "base64"), ("not base64!", "base64"), ("\u0080", "base64")])
def test_an_entry_whose_raw_does_not_decode_is_refused_naming_raw(raw: str, encoding: str) -> None:
    doc: dict[str, Any] = {"schema_version": 1, "id": "e-1", "reason": "max_deliveries", "detail": "", "queue": "q",
                           "list_key": "q", "dead_lettered_at_unix_s": 1.0, "raw": raw, "raw_encoding": encoding}
    data = json.dumps(doc).encode()
    with pytest.raises(DecodeError) as info:
        decode_entry(data)
    assert "raw is not" in str(info.value)
    legacy = read_entry(data)
    assert legacy.reason is Reason.LEGACY and legacy.raw_bytes() == data and legacy.queue == "unknown"


@pytest.mark.parametrize("item", [b"", b"\xff\xfe\x00", b'{"a": 1}', bytes(range(256)) * 40])
def test_entries_a_worker_writes_still_read_back_byte_for_byte(item: bytes) -> None:
    entry = make_entry(item, reason=Reason.BAD_BODY, detail="d", field="body", queue="fleet.demo-lm",
                       list_key="fleet.demo-lm", now_unix_s=1.0)
    again = decode_entry(encode_entry(entry))
    assert again == entry and again.raw_bytes() == item
    if entry.raw_encoding == "base64":
        assert base64.b64decode(entry.raw, validate=True) == item


@pytest.mark.parametrize("limit", ["-1", "-5", "x"])
def test_list_refuses_a_negative_limit(limit: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``--limit -1`` printed every entry but the oldest (``entries[:-1]``), exit 0."""
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["dead-letter", "list", "--limit", limit])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert exited.value.code == 2 and "--limit" in line and "integer >= 0" in line, line


@pytest.mark.parametrize("argv", [["list"], ["show", "x"], ["requeue", "x"], ["delete", "x"], ["purge", "--all"]])
def test_each_command_says_redis_is_down_with_exit_1(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FLEET_REDIS_URL", DOWN)
    code = fleet_main(["dead-letter", *argv])
    out, err = capsys.readouterr()
    assert code == 1 and out == "", out
    [line] = [x for x in err.splitlines() if x.strip()]
    assert line.startswith("fleet: cannot reach Redis at redis://127.0.0.1:1/0") and "fleet redis" in line, line
