"""``workers.result_repr``: the result text of task-succeeded events, fast, and as long as Celery allows (pure)."""

from __future__ import annotations

from typing import Any

from celery.utils.saferepr import saferepr

from workers.result_repr import fast_saferepr

RESULT: dict[str, Any] = {
    "request_id": "abc", "model": "demo-lm", "kind": "next_token", "truncated": False, "embedding": None,
    "timings": {"queue_wait_ms": 1.234, "batch_started_unix_s": 1796337992.540693, "worker": "w@h"},
    "top_k": [{"token_id": i, "logprob": -1.25 * i} for i in range(5)],
}  # fmt: skip


def test_a_json_result_reads_as_celery_shows_it() -> None:
    assert fast_saferepr(RESULT, 16_384) == saferepr(RESULT, 16_384) == repr(RESULT)
    assert fast_saferepr([1, 2.5, None, True], 1024) == saferepr([1, 2.5, None, True], 1024)


def test_longer_than_the_limit_or_not_json_goes_to_celerys_saferepr() -> None:
    big = {"embedding": [0.125] * 2000}
    assert fast_saferepr(big, 1024) == saferepr(big, 1024)
    assert len(fast_saferepr(big, 1024)) < len(repr(big))  # cut, as before

    class Odd:
        def __repr__(self) -> str:
            return "<odd>"

    assert fast_saferepr(Odd(), 1024) == saferepr(Odd(), 1024)
    assert fast_saferepr({"text": "a\nb"}, 1024) == "{'text': 'a\\nb'}"  # escaped, as Python's repr writes it
