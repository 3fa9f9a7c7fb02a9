"""The batch policy as a table: time, pending sequences and arrivals in; a decision out."""

from __future__ import annotations

import pytest

from workers.policy import BatchPolicy, Dispatch, Pending, Wait


def p(arrived_s: float, tokens: int = 10) -> Pending:
    return Pending(arrived_s, tokens)


POLICY = BatchPolicy(max_batch_size=4, max_wait_ms=10, max_batch_tokens=100)

CASES = [
    # (now_s, pending, arriving, expected)
    ("nothing pending", 5.0, [], 0, Wait(None)),
    ("full batch at once", 5.0, [p(5.0)] * 4, 3, Dispatch(4, "full")),
    ("more than a batch", 5.0, [p(5.0)] * 9, 3, Dispatch(4, "full")),
    ("lone request, nothing on its way", 5.0, [p(5.0)], 0, Dispatch(1, "idle")),
    ("company on its way: wait for the window", 5.0, [p(5.0)], 2, Wait(5.010)),
    ("window measured from the oldest", 5.004, [p(5.0), p(5.003)], 1, Wait(5.010)),
    ("window closed", 5.010, [p(5.0), p(5.003)], 1, Dispatch(2, "window")),
    ("token budget: 3 x 30 fits, 4 x 30 does not", 5.0, [p(5.0, 30)] * 4, 1, Dispatch(3, "token_budget")),
    ("one long sequence alone past the budget", 5.0, [p(5.0, 500), p(5.0, 5)], 1, Dispatch(1, "token_budget")),
    (
        "budget counts the longest of the prefix: 3 x 60 > 100",
        5.0,
        [p(5.0, 10), p(5.0, 10), p(5.0, 60)],
        1,
        Dispatch(2, "token_budget"),
    ),
    ("short ones fill up to the budget", 5.020, [p(5.0, 25)] * 3, 1, Dispatch(3, "window")),
]


@pytest.mark.parametrize(("name", "now_s", "pending", "arriving", "expected"), CASES, ids=[c[0] for c in CASES])
def test_decide(name: str, now_s: float, pending: list[Pending], arriving: int, expected: Dispatch | Wait) -> None:
    got = POLICY.decide(now_s, pending, arriving)
    if isinstance(expected, Wait) and expected.until_s is not None:
        assert isinstance(got, Wait) and got.until_s == pytest.approx(expected.until_s)
    else:
        assert got == expected


def test_close_when_idle_off_waits_out_the_window() -> None:
    policy = BatchPolicy(4, 10, 100, close_when_idle=False)
    assert policy.decide(5.0, [p(5.0)], 0) == Wait(pytest.approx(5.010))  # type: ignore[arg-type]
    assert policy.decide(5.011, [p(5.0)], 0) == Dispatch(1, "window")


def test_zero_window_dispatches_immediately_even_with_company_coming() -> None:
    policy = BatchPolicy(4, 0, 100)
    assert policy.decide(5.0, [p(5.0)], 3) == Dispatch(1, "window")


@pytest.mark.parametrize("args", [(0, 1, 1), (1, -1, 1), (1, 1, 0)])
def test_invalid_limits_are_refused(args: tuple[int, int, int]) -> None:
    with pytest.raises(ValueError, match="max_batch_size"):
        BatchPolicy(*args)
