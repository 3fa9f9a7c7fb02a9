"""A Ctrl-C ends every ``fleet`` command as interrupted (exit 130, ``fleet: interrupted``, no traceback), also
where CPython mishandles it (:mod:`tools.interrupts`).

Found by ``test_first_day_demo_interrupt.py``: a demo that caught the Ctrl-C and printed ``fleet:
interrupted`` died by SIGINT all the same (exit -2), and one printed a traceback ("Exception ignored in:
ConnectionPool.__del__ … KeyboardInterrupt") and ran on. Each test here puts the Ctrl-C exactly there, in
the real entry point run as ``python -m`` (:mod:`tests.integration.interrupted_cli`).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("where", ["string-exec", "finalizer"])
def test_a_ctrl_c_mishandled_by_python_still_ends_the_command_as_interrupted(where: str) -> None:
    done = subprocess.run([sys.executable, "-m", "tests.integration.interrupted_cli", where], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (130, "", "fleet: interrupted\n")
