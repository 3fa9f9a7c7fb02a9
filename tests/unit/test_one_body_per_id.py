"""producer.idempotent_queue.one_body_per_id: one ID names one body inside a call (pure, no Redis)."""

from __future__ import annotations

import pytest

from producer.idempotent_queue import conflict, one_body_per_id
from protocol.errors import IdempotencyConflict


@pytest.mark.parametrize(
    ("ids", "bodies", "firsts"),
    [
        (["a"], ["x"], [0]),
        (["a", "b", "c"], ["x", "y", "x"], [0, 1, 2]),  # other IDs may share a body
        (["a", "b", "a"], ["x", "y", "x"], [0, 1, 0]),  # the same body again is the same request
        (["a", "a", "a"], ["x", "x", "x"], [0, 0, 0]),
    ],
)
def test_repeated_ids_with_one_body_point_at_their_first(ids: list[str], bodies: list[str], firsts: list[int]) -> None:
    assert one_body_per_id(ids, bodies, lambda i: f"requests[{i}]") == firsts


@pytest.mark.parametrize(
    ("ids", "bodies", "field"),
    [
        (["bb-1", "bb-2", "bb-1"], ["x", "y", "z"], "requests[2].request_id"),
        (["a", "a"], ["x", "y"], "requests[1].request_id"),
        (["a", "b", "b", "a"], ["x", "y", "y", "w"], "requests[3].request_id"),
    ],
)
def test_an_id_with_two_bodies_is_refused_naming_the_later(ids: list[str], bodies: list[str], field: str) -> None:
    with pytest.raises(IdempotencyConflict) as info:
        one_body_per_id(ids, bodies, lambda i: f"requests[{i}]")
    assert info.value.field == field
    assert info.value.message.startswith(field.removesuffix(".request_id") + ": request_id ")
    assert "nothing was queued" in info.value.message


def test_a_single_submit_names_the_plain_field() -> None:
    err = conflict("key-1")
    assert err.field == "request_id" and err.message.startswith("request_id 'key-1' is already known")
