"""``fleet models compare``'s shadow verdicts from plain values (:mod:`producer.shadow_verdict`): whether live
workers can answer a shadow sample before anything is sent, the stderr line, the exit code."""

from __future__ import annotations

from typing import Any

import pytest

from producer.shadow_verdict import shadow_exit_code, shadow_not_served, shadow_problem

QUEUES = ("fleet.demo-lm", "fleet.demo-lm.canary")


@pytest.mark.parametrize(
    ("stable", "served", "canary_served", "said"),
    [
        (None, {}, {}, "no live worker serves model 'demo-lm': the shadow sample would wait in fleet.demo-lm and "
                       "fleet.demo-lm.canary until one starts, so nothing was sent (start one: `fleet worker --model "
                       "demo-lm`; `fleet status` lists the workers)"),
        ("1.2.3", {}, {}, "no live worker serves model 'demo-lm': "),
        (None, {"1.0.0": ["a"]}, {}, "no live worker of model 'demo-lm' serves its canary 2.0.0 (none has it "
                                     "loaded): "),
        (None, {"1.0.0": ["a"]}, {"1.9.0": ["a"]}, "no live worker of model 'demo-lm' serves its canary 2.0.0 (none "
                                                   "has it loaded; they have 1.9.0 loaded): "),
        ("1.2.3", {"1.0.0": ["a"]}, {"2.0.0": ["a"]}, "no live worker of model 'demo-lm' serves its stable version "
                                                      "1.2.3 (they serve 1.0.0): "),
        ("1.2.3", {"1.0.0": ["a"]}, {}, "no live worker of model 'demo-lm' serves its stable version 1.2.3 (they serve "
                                        "1.0.0) nor its canary 2.0.0 (none has it loaded): "),
        (None, {"1.0.0": ["a"]}, {"2.0.0": ["a"]}, None),  # a model file: any stable version
        ("1.2.3", {"1.2.3": ["a"], "1.0.0": ["b"]}, {"2.0.0": ["b"]}, None),  # served somewhere: pairs can count
    ],
)
def test_a_shadow_sample_is_sent_only_where_live_workers_serve_both_versions(
    stable: str | None, served: dict[str, list[str]], canary_served: dict[str, list[str]], said: str | None
) -> None:
    line = shadow_not_served("demo-lm", stable, "2.0.0", served, canary_served, QUEUES)
    if said is None:
        assert line is None
    else:
        assert line is not None and line.startswith(said), line
        assert "`fleet worker --model demo-lm`" in line and "nothing was sent" in line


def _doc(**fields: Any) -> dict[str, Any]:
    return {"prompts": 2, "compared": 2, "failed": 0, "unfinished": 0, "cancelled": 0, "timeout_s": 120.0,
            "agreement": 1.0, "not_served": None} | fields  # fmt: skip


@pytest.mark.parametrize(
    ("shadow", "code", "said"),
    [
        (None, 0, None),  # no sample asked for, no canary, not an LM
        (_doc(), 0, None),
        (_doc(prompts=0, compared=0, agreement=None), 0, None),
        (_doc(compared=0, not_served="no live worker serves model 'demo-lm': …", agreement=None), 1,
         "NOT SERVED: no live worker serves model 'demo-lm': …"),
        (_doc(compared=0, failed=2, unfinished=4, cancelled=3, agreement=None, timeout_s=0.5), 1,
         "4 of the 4 shadow requests had no result within 0.5 s (--shadow-timeout-s): cancelled 3 of them, so none "
         "runs later for nobody (one a worker already holds may still end); no shadow pair was compared (2 of 2 "
         "failed or unfinished)"),
        (_doc(compared=1, failed=1, unfinished=1, cancelled=1, agreement=1.0), 0,
         "1 of the 4 shadow requests had no result within 120 s (--shadow-timeout-s): cancelled 1 of them"),
        # every pair answered, none by both versions (a mixed fleet, as the README's walkthrough has): said, exit 0
        (_doc(compared=0, agreement=None), 0, "no shadow pair was compared (0 of 2 failed or unfinished; the others "
                                              "were not computed by the stable and the canary version"),
        (_doc(compared=0, failed=1, agreement=None), 0, "no shadow pair was compared (1 of 2 failed or unfinished; "),
    ],
)
def test_a_sample_with_no_pair_compared_says_why_and_exits_1_when_none_was_answered(
    shadow: dict[str, Any] | None, code: int, said: str | None
) -> None:
    assert shadow_exit_code(shadow) == code
    line = shadow_problem(shadow)
    if said is None:
        assert line is None
    else:
        assert line is not None and line.startswith(said), line
