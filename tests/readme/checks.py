"""What a command's run must show, and how commands that do not run are checked instead."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import shlex
import subprocess
from pathlib import Path

from tests.readme.blocks import Command, fleet_argv, match_template, strip_comment

__all__ = ["output_problems", "reason_problems", "skipped_problems"]

_TEST_PATH = re.compile(r"\btests/[\w/]+\.py\b")


def output_problems(cmd: Command, rc: int, stdout: str, error: str | None = None) -> list[str]:
    """Why ``cmd``'s run does not match the README: its exit status, documented output, ``expect`` markers."""
    problems = []
    if error:
        problems.append(f"raised:\n{error}")
    elif rc != 0:
        problems.append(f"exited {rc}")
    if cmd.template is not None and (missing := match_template(cmd.template, stdout)):
        problems.append(missing)
    problems += [f"expected output matching {regex!r}" for regex in cmd.expects
                 if not re.search(regex, stdout, re.MULTILINE)]
    return problems


def _fleet_parse_problem(argv: list[str]) -> str | None:
    from producer.cli import build_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(argv)
    except SystemExit as exc:
        if exc.code not in (0, None):
            return f"`fleet {shlex.join(argv)}` does not parse: {err.getvalue().strip()[-600:]}"
    return None


def skipped_problems(cmd: Command, workspace: Path) -> list[str]:
    """A command that does not run is still checked where it can be: ``fleet`` arguments parse,
    ``make`` targets exist (``make -n``), ``python -m`` modules exist."""
    argv = fleet_argv(cmd.text)
    if argv is not None:
        problem = _fleet_parse_problem(argv)
        return [problem] if problem else []
    words = shlex.split(strip_comment(cmd.text.replace("\\\n", " ")))
    if words[:1] == ["make"]:
        dry = subprocess.run(["make", "-n", *words[1:]], cwd=workspace, capture_output=True, text=True,
                             timeout=60, check=False)
        return [] if dry.returncode == 0 else [f"`make -n {' '.join(words[1:])}` failed: {dry.stderr.strip()}"]
    if len(words) > 2 and words[0].endswith("bin/python") and words[1] == "-m":
        return [] if importlib.util.find_spec(words[2]) else [f"module {words[2]} does not exist"]
    return []


def reason_problems(reason: str, root: Path) -> list[str]:
    """Every ``tests/...py`` a skip reason names as the block's check must exist."""
    return [f"the skip reason names {path}, which does not exist"
            for path in _TEST_PATH.findall(reason) if not (root / path).exists()]
