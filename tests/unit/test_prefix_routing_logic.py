"""Prefix-aware routing's choice of a worker, from what each live worker holds (pure)."""

from __future__ import annotations

import pytest

from producer.prefix_routing import Holder, held_blocks, pick_holder
from protocol.settings import shared_queue_of


@pytest.mark.parametrize(
    ("flags", "blocks"),
    [([], 0), ([0, 0, 0], 0), ([1, 0, 0], 1), ([1, 1, 0], 2), ([1, 1, 1], 3), ([0, 0, 1], 3)],
)
def test_blocks_held_are_counted_to_the_deepest_digest(flags: list[int], blocks: int) -> None:
    # digests chain: holding block k's digest means holding the prefix up to it, even when the
    # shorter digests were released (a covered entry dropped) or the reply raced a change
    assert held_blocks(flags) == blocks


def test_the_worker_holding_the_most_blocks_wins_unless_its_queue_is_full() -> None:
    a, b, c = Holder("a", 3, 0), Holder("b", 5, 2), Holder("c", 0, 0)
    assert pick_holder([a, b, c], max_queued=4) == b
    assert pick_holder([a, b, c], max_queued=2) == a  # b is busy past the bound
    assert pick_holder([a, Holder("b", 5, 4)], max_queued=4) == a
    assert pick_holder([c], max_queued=4) is None  # nobody holds it: the model's queue
    assert pick_holder([Holder("a", 2, 9), Holder("b", 1, 9)], max_queued=4) is None  # all busy
    assert pick_holder([], max_queued=4) is None


def test_ties_go_to_the_shorter_queue_then_the_name() -> None:
    assert pick_holder([Holder("b", 2, 1), Holder("a", 2, 1), Holder("c", 2, 0)], max_queued=4) == Holder("c", 2, 0)
    assert pick_holder([Holder("b", 2, 1), Holder("a", 2, 1)], max_queued=4) == Holder("a", 2, 1)


def test_a_worker_queue_maps_back_to_its_model_queue() -> None:
    assert shared_queue_of("fleet.demo-lm.w.w1-demo-lm@test") == "fleet.demo-lm"
    assert shared_queue_of("fleet.demo-lm") == "fleet.demo-lm"
    assert shared_queue_of("fleet.demo-lm.canary") == "fleet.demo-lm.canary"
