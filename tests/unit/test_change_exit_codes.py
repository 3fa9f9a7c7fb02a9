"""``fleet models pin`` and ``fleet models canary`` exit codes (pure: no Redis): 1 only when they waited, live
workers run, and none of them serves the version in its role; and what the canary part of the document says."""

from __future__ import annotations

from typing import Any

import pytest

from producer.lifecycle_cli import canary_exit_code, pin_exit_code, served_exit_code
from producer.model_status import canary_served_by, served_by


def beat(host: str, version: str, canary: str | None = None, model: str = "m") -> dict[str, Any]:
    return {"hostname": host, "model": model, "version": version, "canary_version": canary}


def test_canary_served_by_groups_the_models_workers_by_loaded_canary() -> None:
    workers = [beat("w2", "v1", "v2"), beat("w1", "v1", "v2"), beat("w3", "v1"), beat("x1", "v1", "v2", "other")]
    assert canary_served_by(workers, "m") == {"v2": ["w1", "w2"]}  # w3 has none loaded: not listed
    assert served_by(workers, "m") == {"v1": ["w1", "w2", "w3"]}


@pytest.mark.parametrize(
    ("workers", "wait_s", "expected"),
    [
        ([beat("w1", "v1", "v2"), beat("w2", "v1", "v2")], 10.0, 0),  # loaded everywhere
        ([beat("w1", "v1", "v2"), beat("w2", "v1")], 10.0, 0),  # by some: NOT SERVED names w2 on stderr
        ([beat("w1", "v1"), beat("w2", "v1")], 10.0, 1),  # by none: refused (a checksum mismatch), or too slow
        ([beat("w1", "v1", "v0"), beat("w2", "v1")], 10.0, 1),  # a replaced canary still held is not v2
        ([beat("w1", "v2")], 10.0, 1),  # v2 as stable (a worker behind the state) does not load the canary
        ([beat("w1", "v1")], 0.0, 0),  # --wait-s 0: not waited for, not judged
        ([], 10.0, 0),  # no live worker: one that starts reads the state
        ([beat("x1", "v1", "v2", model="other")], 10.0, 0),  # another model's workers do not count
    ],
)
def test_canary_exits_1_when_it_waited_and_no_live_worker_loaded_the_canary(
    workers: list[dict[str, Any]], wait_s: float, expected: int
) -> None:
    doc = {"served": served_by(workers, "m"), "canary_served": canary_served_by(workers, "m")}
    assert canary_exit_code(doc, "v2", wait_s) == expected
    assert served_exit_code(doc, "v2", wait_s, "canary") == expected


@pytest.mark.parametrize(
    ("workers", "wait_s", "expected"),
    [
        ([beat("w1", "v2"), beat("w2", "v2")], 10.0, 0),
        ([beat("w1", "v2"), beat("w2", "v1")], 10.0, 0),
        ([beat("w1", "v1", "v2")], 10.0, 1),  # v2 loaded as the canary is not v2 pinned as stable
        ([beat("w1", "v1")], 10.0, 1),
        ([beat("w1", "v1")], 0.0, 0),
        ([], 10.0, 0),
    ],
)
def test_pin_and_canary_share_one_rule_each_on_its_own_role(
    workers: list[dict[str, Any]], wait_s: float, expected: int
) -> None:
    doc = {"served": served_by(workers, "m"), "canary_served": canary_served_by(workers, "m")}
    assert pin_exit_code(doc, "v2", wait_s) == served_exit_code(doc, "v2", wait_s, "stable") == expected


def test_a_document_without_canary_served_never_counts_as_loaded() -> None:
    """A document of a worker-less read or an older shape: no ``canary_served`` = none loaded."""
    assert canary_exit_code({"served": {"v1": ["w1"]}}, "v2", 10.0) == 1
    assert canary_exit_code({"served": {}}, "v2", 10.0) == 0


def test_canary_waits_as_long_as_pin_by_default() -> None:
    from producer.cli import build_parser

    parser = build_parser()
    pin = parser.parse_args(["models", "pin", "m", "v2"])
    canary = parser.parse_args(["models", "canary", "m", "v2", "--weight", "10"])
    assert canary.wait_s == pin.wait_s == 10.0
    assert parser.parse_args(["models", "canary", "m", "v2", "--weight", "10", "--wait-s", "0"]).wait_s == 0.0
