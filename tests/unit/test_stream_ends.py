"""A generation's stream ends after its result is stored (workers.stream_ends, workers.trace_guard.on_traced):
the ending events of a held stream wait, in order, for the task's trace to be done. Pure logic."""

from __future__ import annotations

from typing import Any

import pytest

from protocol.messages import Usage
from protocol.streams import StreamEvent
from workers import trace_guard
from workers.stream_ends import EndsAfterStore

FINAL = StreamEvent(type="final", index=3, finish_reason="length",
                    usage=Usage(prompt_tokens=1, completion_tokens=3, total_tokens=4))  # fmt: skip
ERROR = StreamEvent(type="error", index=0, error="RequestExpired", message="past its deadline")


def test_the_end_of_a_held_stream_waits_for_its_release_in_order() -> None:
    ends = EndsAfterStore()
    assert ends.keep("r", FINAL) is False  # not held: the publisher writes it at once
    assert ends.hold("r") == []
    assert ends.keep("r", FINAL) and ends.keep("r", ERROR)
    assert ends.release("r") == [FINAL, ERROR]
    assert ends.release("r") == [] and len(ends) == 0
    assert ends.keep("r", FINAL) is False  # released: a late end goes out at once


def test_holding_past_the_limit_lets_the_oldest_go_with_its_events() -> None:
    ends = EndsAfterStore(limit=2)
    ends.hold("a")
    ends.keep("a", FINAL)
    ends.hold("b")
    assert ends.hold("c") == [("a", [FINAL])]
    assert len(ends) == 2
    assert ends.release_all() == [("b", []), ("c", [])] and len(ends) == 0


def _tracer(outcome: Exception | None) -> Any:
    def tracer(uuid: str, args: Any, kwargs: Any, request: Any = None) -> Any:
        if outcome is not None:
            raise outcome
        return "traced"

    return tracer


@pytest.mark.parametrize("raises", [False, True])
def test_the_traced_callbacks_run_after_the_trace_whatever_it_did(
    monkeypatch: pytest.MonkeyPatch, raises: bool
) -> None:
    done: list[str] = []
    monkeypatch.setattr(trace_guard, "_failed_trace", lambda task, task_id, exc: done.append("failed") or "contained")

    def failing(task_id: str) -> None:
        raise RuntimeError("a callback that raises")

    trace_guard.on_traced(failing)  # its error is logged: the next callback and the ack still happen
    trace_guard.on_traced(done.append)
    try:
        out = trace_guard.contain(object(), _tracer(RuntimeError("x") if raises else None))("rid-1", [], {})  # type: ignore[arg-type]
    finally:
        trace_guard.off_traced(failing)
        trace_guard.off_traced(done.append)
    assert out == ("contained" if raises else "traced")
    assert done == (["failed", "rid-1"] if raises else ["rid-1"])  # after the FAILURE stored by _failed_trace
    trace_guard.contain(object(), _tracer(None))("rid-2", [], {})  # type: ignore[arg-type]
    assert done[-1] != "rid-2"  # unsubscribed
