"""``Prefer: wait`` (RFC 7240) as the gateway reads it: a hint, never a refusal."""

from __future__ import annotations

import pytest

from gateway.prefer import prefer_wait_s


@pytest.mark.parametrize(
    ("header", "seconds"),
    [
        ("wait=10", 10.0),
        ("WAIT = 2.5", 2.5),
        ("respond-async, wait=30", 30.0),
        ('wait="7"; foo=bar', 7.0),
        ("handling=lenient,wait=0", 0.0),
    ],
)
def test_the_wait_preference_is_read(header: str, seconds: float) -> None:
    assert prefer_wait_s(header) == seconds


@pytest.mark.parametrize("header", [None, "", "respond-async", "wait=soon", "wait=-1", "wait=nan", "wait=inf",
                                    "waiting=5"])  # fmt: skip
def test_an_absent_or_unreadable_wait_is_none(header: str | None) -> None:
    assert prefer_wait_s(header) is None
