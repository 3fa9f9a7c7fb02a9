"""The gateway's pre-parse checks as pure functions: the JSON shape scan and the API-key rules."""

from __future__ import annotations

import json

import pytest

from gateway.auth import key_from_headers, key_refusal
from gateway.body_guard import BodyBounds, scan_json

BOUNDS = BodyBounds(max_depth=4, max_containers=10, max_strings=12, per_item_note="api.max_batch_requests=2")


@pytest.mark.parametrize(
    ("body", "what", "field"),
    [
        ({"model": "m", "input": [[5], [6]]}, None, None),
        ({"model": "m", "input": [[5]] * 10}, "arrays/objects", "input"),
        ({"model": "m", "input": [[[[[5]]]]]}, "depth", "input"),
        ({"model": "m", "stop": ["a"] * 11}, "strings", "stop"),
        ([[1]] * 11, "arrays/objects", None),
        # brackets and quotes inside strings are text, not structure
        ({"model": "[[[[[[{{{{{", "text": 'a "quoted" [x] \\ {y}'}, None, None),
        ({"model": "m", "input_ids": list(range(50_000))}, None, None),  # numbers are not counted
    ],
)
def test_scan_finds_the_first_bound_broken_and_its_field(body: object, what: str | None, field: str | None) -> None:
    refusal = scan_json(json.dumps(body).encode(), BOUNDS)
    assert (refusal.what, refusal.field) == (what, field) if refusal else what is None
    if refusal:
        assert "api.max_batch_requests=2" in refusal.message(BOUNDS) or refusal.what == "depth"


def test_a_key_comes_from_either_header_and_is_checked_in_full() -> None:
    keys = [b"k1"]
    assert key_from_headers("k1", None) == "k1"
    assert key_from_headers(None, "Bearer k1") == key_from_headers(None, "bearer k1") == "k1"
    assert key_from_headers(None, "Basic k1") is None and key_from_headers(None, None) is None
    assert key_refusal("k1", keys) is None and key_refusal(None, []) is None
    assert "missing API key" in (key_refusal(None, keys) or "")
    assert "wrong API key" in (key_refusal("k", keys) or "")
