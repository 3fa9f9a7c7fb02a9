"""``wait(..., poll_s=...)``: a poll interval is a finite number of seconds > 0, and its refusal says so.

A time limit takes ``None`` or ``inf`` for "no limit"; a poll interval does not, so a refused ``poll_s``
must not offer them as the fix (it did: ``poll_s = 0 must be > 0 s (None or inf: no limit)``, and then
``poll_s=None`` was refused in turn)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from producer.arguments import poll_interval_s
from protocol.errors import InvalidRequest


@pytest.mark.parametrize("value", [0, -1, 0.0, math.nan, math.inf, None, "0.1", True])
def test_a_refused_poll_interval_names_it_and_offers_no_unlimited_value(value: Any) -> None:
    with pytest.raises(InvalidRequest) as info:
        poll_interval_s(value)
    assert info.value.field == "poll_s"
    assert "finite number of seconds > 0" in info.value.message
    assert "no limit" not in info.value.message


@pytest.mark.parametrize(("value", "seconds"), [(0.005, 0.005), (1, 1.0), (2.5, 2.5)])
def test_a_positive_finite_poll_interval_is_kept(value: float, seconds: float) -> None:
    assert poll_interval_s(value) == seconds
