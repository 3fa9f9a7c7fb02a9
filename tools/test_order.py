"""The order ``make test`` hands test files to its pytest-xdist processes: longest first.

``make test`` runs each test file whole in one process (``--dist loadfile``). pytest-xdist's own order
puts the files with the most tests first, so a file of a few long tests (the quick bench, the GPU
report, a multi-host cut) started last, and one process ran it alone while the others had nothing
left. Longest-first (the LPT rule) ends the processes closer together. The seconds of each file come
from one full run's ``--durations=0`` report, kept in ``tests/file_seconds.json``; a file it does not
name (a new one, or one whose every step took under 5 ms) counts :data:`UNKNOWN_TEST_S` per test.
The tiers with venvs of their own (:data:`LAST`) go after everything else: ``.ci/run`` builds those
venvs in the background (100–200 s on 2 cores), and a tier's test that started early would wait for
its build while the others run. Only the order changes, never what runs.

Refresh the figures after a full run::

    python -m pytest -n 3 --dist loadfile --durations=0 | tee var/test-run.log
    python -m tools.test_order var/test-run.log        # rewrites tests/file_seconds.json
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["FILE_SECONDS", "LAST", "UNKNOWN_TEST_S", "file_seconds_from_report", "longest_first"]

ROOT = Path(__file__).resolve().parents[1]
FILE_SECONDS = ROOT / "tests" / "file_seconds.json"
UNKNOWN_TEST_S = 0.1
"""Seconds counted per test of a file ``tests/file_seconds.json`` does not name."""
LAST = ("tests/genai/", "tests/gpu_wheel/", "tests/guidellm/", "tests/optimum/")
"""The tiers whose venvs build in the background (:mod:`tools.tier_venvs`): their files run last."""

_DURATION = re.compile(r"^(?P<s>\d+(?:\.\d+)?)s (?:setup|call|teardown)\s+(?P<file>[^:\s]+\.py)::")


def file_seconds_from_report(lines: Sequence[str]) -> dict[str, float]:
    """Seconds per test file (setup, call and teardown summed) from pytest's ``--durations=0`` lines."""
    seconds: dict[str, float] = {}
    for line in lines:
        if m := _DURATION.match(line.strip()):
            seconds[m["file"]] = seconds.get(m["file"], 0.0) + float(m["s"])
    return {f: round(s, 1) for f, s in sorted(seconds.items(), key=lambda kv: -kv[1])}


def longest_first(files: Sequence[str], tests_per_file: dict[str, int], seconds: dict[str, float]) -> list[str]:
    """``files`` (each once, in collection order) sorted by expected seconds, longest first, the :data:`LAST`
    tiers' after the others; ties keep collection order. A file not in ``seconds`` is expected to take
    :data:`UNKNOWN_TEST_S` per test."""
    def expected(f: str) -> float:
        return seconds.get(f, UNKNOWN_TEST_S * tests_per_file.get(f, 1))

    place = {f: i for i, f in enumerate(files)}
    return sorted(files, key=lambda f: (f.startswith(LAST), -expected(f), place[f]))


def main(argv: Sequence[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tools.test_order PYTEST_LOG   (a run with --durations=0)", file=sys.stderr)
        return 2
    seconds = file_seconds_from_report(Path(argv[0]).read_text(errors="replace").splitlines())
    if not seconds:
        print(f"{argv[0]}: no --durations=0 lines found", file=sys.stderr)
        return 1
    FILE_SECONDS.write_text(json.dumps(seconds, indent=0) + "\n")
    print(f"wrote {FILE_SECONDS.relative_to(ROOT)}: {len(seconds)} files, {sum(seconds.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
