"""The README is executed: every ```bash and ```python block runs against a real fleet, one test per block.

The whole README runs once per session (``python -m tests.readme.runner``: a private network and PID
namespace where Redis is on 6379 and the gateway on 8000, as documented; ~1.5 minutes on 2 cores);
each test then reports one block: its commands' exit statuses, the output the README documents for
them, and its markers' checks. :mod:`tests.readme.blocks` says how blocks are classified and how
documented output is matched; run one block with ``python -m tests.readme.runner --only L76-bash``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from typing import Any

import pytest

from tests.readme.blocks import Block, ReadmeError, classification_problems, parse_readme
from tests.readme.fleet import ROOT

pytestmark = [
    pytest.mark.readme,
    pytest.mark.timeout(600),
    pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux unshare is missing"),
]

try:
    BLOCKS, PARSE_ERROR = parse_readme(ROOT / "README.md"), None
except ReadmeError as exc:
    BLOCKS, PARSE_ERROR = [], str(exc)


def test_every_block_is_classified() -> None:
    """A block the runner cannot run (an unknown language, a stale or malformed marker) fails here."""
    assert PARSE_ERROR is None, PARSE_ERROR
    assert classification_problems(BLOCKS) == []
    assert {b.lang for b in BLOCKS if b.kind == "run"} == {"bash", "python"}


@pytest.fixture(scope="module")
def run_doc(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The runner's whole report (every block, and the ready state after the last)."""
    workdir = tmp_path_factory.mktemp("readme")
    out = workdir / "report.json"
    done = subprocess.run([sys.executable, "-m", "tests.readme.runner", "--workdir", str(workdir), "--report",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=540, check=False)
    if not out.exists():
        pytest.fail(f"the runner exited {done.returncode} without a report:\n{done.stderr[-4000:]}")
    doc: dict[str, Any] = json.loads(out.read_text())
    if doc.get("error"):
        pytest.fail(f"the README run did not start: {doc['error']}\n{done.stderr[-4000:]}")
    return doc


@pytest.fixture(scope="module")
def report(run_doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each block's result by block id."""
    return {b["id"]: b for b in run_doc["blocks"]}


def _explain(result: dict[str, Any]) -> str:
    lines = [f"README line {result['line']} ({result['section']}): {p}" for p in result["problems"]]
    for cmd in result["commands"]:
        if cmd["problems"]:
            lines.append(f"\n$ {cmd['head']}   (README line {cmd['line']}, exit {cmd['rc']})")
            lines += [f"  ✗ {p}" for p in cmd["problems"]]
            lines.append(f"  stdout: {cmd['stdout'][-2000:]}")
            lines.append(f"  stderr: {cmd['stderr'][-2000:]}")
    return "\n".join(lines)


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"{b.id}-{b.kind}")
def test_block(block: Block, report: dict[str, dict[str, Any]]) -> None:
    result = report.get(block.id)
    assert result is not None, f"the run has no result for the block at README line {block.line}"
    assert result["ok"], _explain(result)


def test_the_run_has_no_unknown_blocks(report: dict[str, dict[str, Any]]) -> None:
    """The run and this module read the same README (no block was added while it ran)."""
    assert set(report) == {b.id for b in BLOCKS}


def test_the_readme_steps_end_ready(run_doc: dict[str, Any]) -> None:
    """After every block ran on a fleet of only the workers the README starts, the fleet is ready."""
    ready_after = run_doc.get("ready_after")
    assert ready_after, "the run recorded no ready state after its blocks"
    assert ready_after["probe_rc"] == 0, f"fleet probe ready: {ready_after['probe_output']}"
    assert ready_after["readyz_status"] == 200, f"/readyz: {ready_after['readyz_status']} {ready_after['readyz_body']}"
