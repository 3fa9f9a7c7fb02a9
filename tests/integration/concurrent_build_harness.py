"""A ``fleet build-model`` process a test can pause at every file it publishes.

``python -m tests.integration.concurrent_build_harness BUILD-MODEL-ARGS...`` runs
:func:`tools.build_model.main` with two spies installed:

* before every ``os.replace(src, dst)`` (``Path.replace`` calls it too) it prints
  ``@@ replace <dst>`` and waits for one line on stdin, so the test sees the folder exactly as a reader
  would between two renames, then lets the rename happen;
* before every ``fcntl.flock`` it prints ``@@ lock <path>`` (no wait): the next thing this builder does
  may be to block on another builder's lock.

Any other output (the builder's own lines) does not start with ``@@``.
"""

from __future__ import annotations

import fcntl
import os
import sys
from typing import Any

from tools.build_model import main

_real_replace = os.replace
_real_flock = fcntl.flock


def _say(line: str) -> None:
    sys.stdout.write(f"@@ {line}\n")
    sys.stdout.flush()


def _paused_replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
    _say(f"replace {os.fspath(dst)}")
    if not sys.stdin.readline():
        raise SystemExit("test went away")
    _real_replace(src, dst, *args, **kwargs)


def _announced_flock(fd: Any, operation: int) -> None:
    _say(f"lock {operation}")
    _real_flock(fd, operation)


if __name__ == "__main__":
    os.replace = _paused_replace
    fcntl.flock = _announced_flock
    raise SystemExit(main(sys.argv[1:]))
