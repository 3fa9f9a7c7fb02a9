"""Run README.md's code blocks against a real fleet; write what each did as JSON.

``python -m tests.readme.runner [--report PATH] [--workdir DIR] [--only L75-bash,...]`` re-runs itself
inside fresh network and PID namespaces (``unshare --net --pid``; as non-root with ``--user
--map-root-user``) where only a loopback interface exists, so the README's addresses (127.0.0.1:6379,
:8000, :5555) are its own and are used exactly as written, and nothing it started outlives the run.
There it starts the fleet (:mod:`tests.readme.fleet`), then the README's ``server`` blocks (the
gateway), then runs every block in README order as :mod:`tests.readme.blocks` classifies it; the exit
status is 0 when every block passed. ``tests/readme/test_readme.py`` runs it for ``make test`` and
reports one test per block.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.readme.blocks import (
    Block,
    Command,
    ReadmeError,
    bash_commands,
    classification_problems,
    parse_readme,
    python_statements,
)
from tests.readme.checks import output_problems, reason_problems, skipped_problems
from tests.readme.fleet import ROOT, EmbeddedFleet, clean_environ, make_workspace, readme_worker_models
from tests.readme.shell import CommandTimeout, Shell, end_group
from tools.processes import die_with_parent

__all__ = ["BlockResult", "main", "netns_prefix"]

COMMAND_TIMEOUT_S = 240.0  # make demo is the longest (~30 s here)
POLL_FOR_S = 20.0
SERVER_READY_S = 60.0


@dataclass
class CommandResult:
    line: int
    head: str
    rc: int | None = None
    seconds: float = 0.0
    stdout: str = ""
    stderr: str = ""
    problems: list[str] = field(default_factory=list)
    skipped: str | None = None


@dataclass
class BlockResult:
    id: str
    line: int
    lang: str
    section: str
    kind: str
    ok: bool = True
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)
    commands: list[CommandResult] = field(default_factory=list)
    note: str = ""


def netns_prefix() -> list[str]:
    """The ``unshare`` words for a fresh network and PID namespace with a private /proc.

    The PID namespace ends every process the README started when the run ends, however it ends
    (``--kill-child``: even if the runner is killed); its PID 1 is a ``bash`` that reaps orphans.
    """
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    return ["unshare", *user, "--net", "--pid", "--fork", "--kill-child", "--mount-proc"]


class Runner:
    """Runs blocks in ``workspace`` against the fleet; keeps the server blocks' shells until :meth:`close`."""

    def __init__(self, workspace: Path, logs: Path) -> None:
        self.workspace = workspace
        self.logs = logs
        self.env = clean_environ()
        self.servers: list[Shell] = []
        self._n = 0

    def _scratch(self, block: Block) -> Path:
        self._n += 1
        return self.logs / f"{self._n:02d}-{block.id}"

    # -- bash ---------------------------------------------------------------------------------------
    def _command(self, shell: Shell, cmd: Command, res: CommandResult) -> None:
        deadline = time.monotonic() + POLL_FOR_S
        while True:
            ran = shell.run(cmd.text, COMMAND_TIMEOUT_S)
            res.rc, res.stdout, res.stderr, res.seconds = ran.rc, ran.stdout, ran.stderr, ran.seconds
            res.problems = output_problems(cmd, ran.rc, ran.stdout)
            if not (cmd.poll and res.problems and time.monotonic() < deadline):
                return
            time.sleep(0.25)

    def bash(self, block: Block, out: BlockResult) -> None:
        shell = Shell(self.workspace, self.env, self._scratch(block))
        try:
            for cmd in block.commands():
                res = CommandResult(cmd.line, cmd.head, skipped=cmd.skipped)
                out.commands.append(res)
                if cmd.skipped:
                    res.problems = skipped_problems(cmd, self.workspace) + reason_problems(cmd.skipped, ROOT)
                    continue
                try:
                    self._command(shell, cmd, res)
                except CommandTimeout as exc:
                    res.problems.append(str(exc))
                    return
        finally:
            shell.close()

    def server(self, block: Block, out: BlockResult) -> None:
        """All commands but the last as in :meth:`bash`; the last keeps running until :meth:`close`."""
        marker = block.marker("server")
        assert marker is not None
        *setup, last = block.commands()
        shell = Shell(self.workspace, self.env, self._scratch(block))
        self.servers.append(shell)
        for cmd in setup:
            res = CommandResult(cmd.line, cmd.head)
            out.commands.append(res)
            self._command(shell, cmd, res)
        res = CommandResult(last.line, last.head)
        out.commands.append(res)
        shell.send(last.text)
        started = time.monotonic()
        while time.monotonic() - started < SERVER_READY_S:
            try:
                with urllib.request.urlopen(marker.url, timeout=2):
                    res.seconds = time.monotonic() - started
                    return
            except OSError:
                time.sleep(0.2)
        res.problems.append(f"{marker.url} did not answer within {SERVER_READY_S:.0f} s:\n{shell.err.rest()[-3000:]}")

    # -- python, yaml, skip ---------------------------------------------------------------------------
    def python(self, block: Block, out: BlockResult) -> None:
        scratch = self._scratch(block)
        scratch.mkdir(parents=True)
        source, report = scratch / "block.py", scratch / "report.json"
        source.write_text(block.code)
        proc = subprocess.Popen([str(self.workspace / ".venv/bin/python"), "-m", "tests.readme.pyexec",
                                 str(source), str(report)], cwd=self.workspace, env=self.env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                                preexec_fn=die_with_parent)
        try:
            _, stderr = proc.communicate(timeout=COMMAND_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            end_group(proc.pid, reap=proc.poll)
            out.problems.append(f"no end after {COMMAND_TIMEOUT_S:.0f} s")
            return
        finally:
            end_group(proc.pid, grace_s=5, reap=proc.poll)
        if not report.exists():
            out.problems.append(f"the interpreter exited {proc.returncode}: {stderr[-3000:]}")
            return
        ran = {r["line"] + block.line: r for r in json.loads(report.read_text())}
        for stmt in python_statements(block.code, block.line + 1):
            if (r := ran.get(stmt.line)) is None:
                break
            out.commands.append(CommandResult(stmt.line, stmt.head, rc=0, seconds=r["seconds"], stdout=r["stdout"],
                                              stderr=stderr if r["error"] else "",
                                              problems=output_problems(stmt, 0, r["stdout"], r["error"])))

    def yaml(self, block: Block, out: BlockResult) -> None:
        """Parse it; run every ``exec`` probe command (``python`` is the environment's, as in an image)."""
        env = {**self.env, "PATH": f"{self.workspace / '.venv/bin'}:{self.env.get('PATH', '')}",
               "HOSTNAME": socket.gethostname()}
        for argv in _exec_commands(yaml.safe_load(block.code)):
            done = subprocess.run(argv, cwd=self.workspace, env=env, capture_output=True, text=True,
                                  timeout=60, check=False)
            res = CommandResult(block.line, " ".join(argv), rc=done.returncode, stdout=done.stdout,
                                stderr=done.stderr)
            res.problems = [] if done.returncode == 0 else [f"probe exited {done.returncode}"]
            out.commands.append(res)

    def skip(self, block: Block, out: BlockResult) -> None:
        marker = block.marker("skip")
        assert marker is not None
        out.note = marker.reason
        out.problems += reason_problems(marker.reason, ROOT)
        if block.lang == "bash":
            for cmd in bash_commands(block.code, block.line + 1):
                out.commands.append(CommandResult(cmd.line, cmd.head, skipped=marker.reason,
                                                  problems=skipped_problems(cmd, self.workspace)))

    def run(self, block: Block) -> BlockResult:
        out = BlockResult(block.id, block.line, block.lang, block.section, block.kind)
        started = time.monotonic()
        handler = {"run": self.bash if block.lang == "bash" else self.python, "server": self.server,
                   "yaml": self.yaml, "skip": self.skip}.get(block.kind)
        try:
            if handler is not None:
                handler(block, out)
        except Exception as exc:  # a broken block must not stop the others
            out.problems.append(f"runner error: {type(exc).__name__}: {exc}")
        out.seconds = round(time.monotonic() - started, 2)
        out.ok = not out.problems and not any(c.problems for c in out.commands)
        return out

    def close(self) -> None:
        for shell in self.servers:
            shell.close()


def _exec_commands(doc: Any) -> list[list[str]]:
    if isinstance(doc, dict):
        if isinstance(doc.get("exec"), dict) and isinstance(doc["exec"].get("command"), list):
            return [[str(word) for word in doc["exec"]["command"]]]
        return [argv for value in doc.values() for argv in _exec_commands(value)]
    if isinstance(doc, list):
        return [argv for value in doc for argv in _exec_commands(value)]
    return []


def _run_inside(readme: Path, workdir: Path, only: set[str]) -> dict[str, Any]:
    blocks = parse_readme(readme)
    if problems := classification_problems(blocks):
        raise ReadmeError("; ".join(problems))
    workspace, logs = make_workspace(workdir / "workspace"), workdir / "logs"
    fleet = EmbeddedFleet(workspace, logs, readme_worker_models(readme))
    runner = Runner(workspace, logs)
    results: list[BlockResult] = []
    try:
        fleet.start()
        for block in blocks:
            if block.kind == "server":
                results.append(runner.run(block))
                _say(results[-1])
        for block in blocks:
            if block.kind != "server" and (not only or block.id in only):
                results.append(runner.run(block))
                _say(results[-1])
        ready = ready_after(workspace, runner.env) if not only else None
    finally:
        runner.close()
        fleet.stop()
    return {"blocks": [asdict(r) for r in sorted(results, key=lambda r: r.line)], "ready_after": ready}


def ready_after(workspace: Path, env: dict[str, str]) -> dict[str, Any]:
    """Where the reader stands once every block ran: ``fleet probe ready`` and the gateway's ``/readyz``."""
    probe = subprocess.run([str(workspace / ".venv/bin/fleet"), "probe", "ready"], cwd=workspace, env=env,
                           capture_output=True, text=True, timeout=60, check=False)
    try:
        with urllib.request.urlopen("http://127.0.0.1:8000/readyz", timeout=10) as resp:
            status, body = resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        status, body = exc.code, exc.read().decode()
    except OSError as exc:
        status, body = 0, f"{type(exc).__name__}: {exc}"
    return {"probe_rc": probe.returncode, "probe_output": (probe.stdout + probe.stderr)[-2000:],
            "readyz_status": status, "readyz_body": body[-2000:]}


def _say(result: BlockResult) -> None:
    state = "ok" if result.ok else "FAILED"
    print(f"readme: {result.id:<14} {result.kind:<6} {state:<6} {result.seconds:6.1f} s  {result.section}",
          file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.readme.runner", description=__doc__.splitlines()[0])
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md")
    parser.add_argument("--report", type=Path, default=Path("readme-report.json"))
    parser.add_argument("--workdir", type=Path, default=None, help="workspace and logs (default: a temp folder)")
    parser.add_argument("--only", default="", help="comma-separated block ids, e.g. L75-bash (the fleet always starts)")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.inside:
        workdir = args.workdir or Path(tempfile.mkdtemp(prefix="readme-run-"))
        cmd = [*netns_prefix(), "bash", "-c", 'ip link set lo up && "$0" "$@"; exit $?',
               sys.executable, "-m", "tests.readme.runner", "--inside", "--readme",
               str(args.readme.resolve()), "--report", str(args.report.resolve()), "--workdir", str(workdir.resolve()),
               "--only", args.only]
        rc = subprocess.run(cmd, cwd=ROOT, check=False).returncode
        if args.workdir is None and rc == 0:
            shutil.rmtree(workdir, ignore_errors=True)
        return rc
    started = time.monotonic()
    try:
        report = _run_inside(args.readme, args.workdir, {s for s in args.only.split(",") if s})
    except (ReadmeError, RuntimeError, TimeoutError, OSError) as exc:
        report = {"blocks": [], "error": f"{type(exc).__name__}: {exc}"}
    report["seconds"] = round(time.monotonic() - started, 1)
    args.report.write_text(json.dumps(report, indent=1))
    failed = [b["id"] for b in report["blocks"] if not b["ok"]]
    print(f"readme: {len(report['blocks'])} blocks, {len(failed)} failed {failed or ''} in {report['seconds']} s"
          + (f"; {report['error']}" if report.get("error") else ""), file=sys.stderr)
    return 1 if failed or report.get("error") else 0


if __name__ == "__main__":
    raise SystemExit(main())
