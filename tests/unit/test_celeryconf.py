"""Unit tests of the broker transport options :func:`protocol.celeryconf.celery_config` derives."""

from __future__ import annotations

import pytest

from protocol.celeryconf import celery_config, restore_interval_s, restore_lock_life_s
from protocol.settings import load_settings


@pytest.mark.parametrize(("visibility_s", "interval_s", "lock_s"),
                         [(1, 1, 1), (3, 1, 1), (40, 10, 10), (100, 25, 25), (3600, 30, 30), (86400, 30, 30)])
def test_restore_scan_interval_and_lock_life(visibility_s: int, interval_s: int, lock_s: int) -> None:
    assert restore_interval_s(visibility_s) == interval_s
    assert restore_lock_life_s(visibility_s) == lock_s


def test_transport_options_bound_the_restore_lock() -> None:
    options = celery_config(load_settings("/dev/null", visibility_timeout_s=3600))["broker_transport_options"]
    assert options["unacked_mutex_expire"] == 30  # one scan interval; kombu's own default is 300 s
    assert options["unacked_restore_interval"] == 30
    assert options["unacked_restore_throttle"] == 1
