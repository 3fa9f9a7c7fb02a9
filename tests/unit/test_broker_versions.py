"""The worker's celery/kombu version check and the lock file's guard (pure: version strings in, verdicts out)."""

from __future__ import annotations

import logging

import pytest

from broker.versions import OVERRIDE_ENV, TESTED, check_broker_versions, untested
from protocol.errors import ConfigError
from tools.lock_constraints import render

RANGE = {"kombu": ">=5.7,<5.8"}


@pytest.mark.parametrize(
    ("version", "inside"),
    [
        ("5.7.0", True),
        ("5.7.12", True),
        ("5.6.2", False),  # the minor before
        ("5.8.0", False),  # the next minor: not tested yet
        ("6.0.0", False),
        ("5.7.1rc1", False),  # a pre-release is never what the tests ran
        ("5.8.0b1", False),
        ("not installed", False),
        ("garbage", False),
    ],
)
def test_untested_names_the_version_and_the_range(version: str, inside: bool) -> None:
    expected = [] if inside else [f"kombu {version} (tested: >=5.7,<5.8)"]
    assert untested({"kombu": version}, RANGE) == expected


def test_a_missing_distribution_is_untested() -> None:
    assert untested({}, RANGE) == ["kombu not installed (tested: >=5.7,<5.8)"]


def test_an_untested_kombu_is_refused_with_the_reason_and_the_ways_out() -> None:
    with pytest.raises(ConfigError) as err:
        check_broker_versions(False, {"celery": "5.7.0", "kombu": "5.6.2"})
    message = str(err.value)
    assert message.startswith(f"untested kombu 5.6.2 (tested: {TESTED['kombu']})")
    assert "_brpop_read" in message and "pip install -c constraints.txt" in message and f"{OVERRIDE_ENV}=1" in message
    assert err.value.field == "worker.allow_untested_kombu" and err.value.limit == dict(TESTED)


def test_celery_is_checked_too() -> None:
    with pytest.raises(ConfigError, match=r"untested celery 5\.8\.0 \(tested: >=5\.7,<5\.8\)"):
        check_broker_versions(False, {"celery": "5.8.0", "kombu": "5.7.0"})


def test_the_override_starts_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="fleet.worker"):
        found = check_broker_versions(True, {"celery": "5.7.0", "kombu": "5.8.1"})
    assert found == [f"kombu 5.8.1 (tested: {TESTED['kombu']})"]
    assert "starting on untested kombu 5.8.1" in caplog.text and "worker.allow_untested_kombu is set" in caplog.text


def test_tested_versions_pass_silently(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="fleet.worker"):
        assert check_broker_versions(False, {"celery": "5.7.0", "kombu": "5.7.0"}) == []
    assert caplog.text == ""


def test_the_lock_file_refuses_to_pin_an_untested_kombu() -> None:
    with pytest.raises(SystemExit, match=r"refusing to lock untested kombu 5\.6\.2"):
        render(["celery==5.7.0", "kombu==5.6.2", "redis==8.2.0"], "3.11")
    text = render(["celery==5.7.0", "kombu==5.7.0", "redis==8.2.0"], "3.11")
    assert text.startswith("# Pip constraints") and text.endswith("kombu==5.7.0\nredis==8.2.0\n")
