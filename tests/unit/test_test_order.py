"""tools.test_order: the seconds per file read from pytest's ``--durations=0`` report, and the longest-first
order of files (pure)."""

from __future__ import annotations

from tools.test_order import UNKNOWN_TEST_S, file_seconds_from_report, longest_first

REPORT = """
============================= slowest durations ==============================
226.70s setup    tests/readme/test_readme.py::test_block[L11-bash-run]
70.27s call     tests/integration/test_bench_smoke.py::test_quick_bench_end_to_end
28.40s call     tests/integration/test_bench_smoke.py::test_quick_dispatch_phase_alone_measures_each_path
0.51s teardown tests/integration/test_bench_smoke.py::test_quick_bench_end_to_end
0.01s call     tests/unit/test_x.py::test_a[with::colons in id]
(1820 durations < 0.005s hidden.  Use -vv to show these durations.)
FAILED tests/unit/test_x.py::test_b - AssertionError: 1.00s call
"""


def test_seconds_are_summed_per_file_over_setup_call_and_teardown() -> None:
    seconds = file_seconds_from_report(REPORT.splitlines())
    assert seconds == {"tests/readme/test_readme.py": 226.7, "tests/integration/test_bench_smoke.py": 99.2,
                       "tests/unit/test_x.py": 0.0}  # fmt: skip
    assert list(seconds) == ["tests/readme/test_readme.py", "tests/integration/test_bench_smoke.py",
                             "tests/unit/test_x.py"]  # fmt: skip


def test_files_go_longest_first_and_an_unknown_file_counts_per_test() -> None:
    files = ["a.py", "b.py", "new.py", "c.py", "d.py"]
    seconds = {"a.py": 2.0, "b.py": 90.0, "c.py": 2.0, "d.py": 0.5}
    tests = {"a.py": 3, "b.py": 1, "new.py": 40, "c.py": 7, "d.py": 1}
    assert UNKNOWN_TEST_S * 40 > 2.0 > UNKNOWN_TEST_S * 7
    # new.py: 40 tests at UNKNOWN_TEST_S each; a and c tie and keep their collection order
    assert longest_first(files, tests, seconds) == ["b.py", "new.py", "a.py", "c.py", "d.py"]
    assert longest_first(files, tests, {}) == ["new.py", "c.py", "a.py", "b.py", "d.py"]


def test_the_tiers_with_venvs_of_their_own_go_last_longest_first() -> None:
    files = ["tests/genai/test_g.py", "tests/guidellm/test_h.py", "tests/integration/test_i.py", "tests/unit/test_u.py"]
    seconds = {"tests/genai/test_g.py": 16.0, "tests/guidellm/test_h.py": 35.0, "tests/integration/test_i.py": 3.0,
               "tests/unit/test_u.py": 0.2}  # fmt: skip
    assert longest_first(files, {}, seconds) == ["tests/integration/test_i.py", "tests/unit/test_u.py",
                                                 "tests/guidellm/test_h.py", "tests/genai/test_g.py"]  # fmt: skip
