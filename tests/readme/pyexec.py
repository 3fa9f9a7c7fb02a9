"""Run one README Python block statement by statement in this (fresh) interpreter; report as JSON.

``python -m tests.readme.pyexec BLOCK.py REPORT.json``: each top-level statement runs in one shared
``__main__`` namespace with its stdout captured on its own; the first exception ends the block.
The report is a list of ``{"line", "stdout", "error", "seconds"}`` (``line`` within the block, 1-based).
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

__all__ = ["main"]


def main(argv: list[str]) -> int:
    source = Path(argv[0]).read_text()
    tree = ast.parse(source, filename=argv[0])
    namespace: dict[str, Any] = {"__name__": "__main__"}
    report: list[dict[str, Any]] = []
    for stmt in tree.body:
        buf = io.StringIO()
        started = time.monotonic()
        error = None
        try:
            code = compile(ast.Module(body=[stmt], type_ignores=[]), argv[0], "exec")
            with contextlib.redirect_stdout(buf):
                exec(code, namespace)
        except BaseException:  # report whatever the block raised, SystemExit included
            error = traceback.format_exc(limit=-3)
        report.append({"line": stmt.lineno, "stdout": buf.getvalue(), "error": error,
                       "seconds": round(time.monotonic() - started, 3)})
        if error:
            break
    Path(argv[1]).write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
