"""Day one: stopping `fleet demo` midway (Ctrl-C, `kill`) ends it as interrupted and leaves nothing running.

The README promises exit 130 for Ctrl-C, no traceback, and a demo that "shuts everything down". Each test runs
the real command (its private redis-server, two celery workers), waits until it says its workers are ready,
signals it, and checks the exit, the last line and that every process it started is gone.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from tools.processes import poll_until

ROOT = Path(__file__).resolve().parents[2]
READY_LINE = "ready: model demo-encoder"  # the demo's last worker is ready: it submits next
START_S = 180.0  # a cold start builds the demo models and starts two workers on a shared 2-core machine
STOP_S = 60.0


def _ignore_sigint() -> None:
    """What a non-interactive shell does to `fleet demo &`: the child inherits SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _start_demo(preexec: Callable[[], None] | None) -> tuple[subprocess.Popen[str], queue.Queue[str | None]]:
    """The demo, and the queue its stderr's lines arrive on (``None`` last: its stderr is closed)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}  # the embedded default
    proc = subprocess.Popen([sys.executable, "-m", "producer.cli", "demo", "--no-flower"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=preexec)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return proc, lines


def _until_line(proc: subprocess.Popen[str], lines: queue.Queue[str | None], wanted: str) -> list[str]:
    seen: list[str] = []

    def arrived() -> bool:
        while not lines.empty():
            line = lines.get_nowait()
            if line is not None:
                seen.append(line)
        if proc.poll() is not None:
            pytest.fail(f"fleet demo exited {proc.returncode} before {wanted!r}:\n{''.join(seen)[-3000:]}")
        return any(wanted in line for line in seen)

    poll_until(arrived, START_S, what=f"fleet demo to print {wanted!r}", poll_s=0.05)
    return seen


def _children(pid: int) -> list[psutil.Process]:
    children: list[psutil.Process] = psutil.Process(pid).children(recursive=True)
    return children


def _stopped(proc: subprocess.Popen[str], lines: queue.Queue[str | None], seen: list[str],
             children: list[psutil.Process]) -> str:
    """Wait for the demo's exit; return its stderr; fail if a process it started outlives it."""
    try:
        proc.wait(STOP_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    _, alive = psutil.wait_procs(children, timeout=STOP_S)
    for p in alive:
        p.kill()
    while (line := lines.get(timeout=STOP_S)) is not None:  # to the end of its stderr, its last line included
        seen.append(line)
    err = "".join(seen)
    assert not alive, f"still running after fleet demo ended: {[p.cmdline() for p in alive]}"
    return err


def _assert_interrupted(rc: int | None, err: str) -> None:
    assert rc == 130, f"exit {rc}, not 130 (interrupted):\n{err[-3000:]}"
    assert err.rstrip().splitlines()[-1] == "fleet: interrupted", err[-3000:]
    assert "Traceback" not in err, err[-3000:]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_a_signal_to_a_backgrounded_demo_stops_it_as_interrupted(sig: signal.Signals) -> None:
    """`fleet demo &` in a script, then `kill -INT` / `kill`: before, SIGINT was ignored (the demo ran on to
    exit 0) and SIGTERM killed it outright (exit -15, no shutdown); now both stop everything: exit 130."""
    proc, lines = _start_demo(_ignore_sigint)
    seen = _until_line(proc, lines, READY_LINE)
    children = _children(proc.pid)
    assert any("redis-server" in " ".join(p.cmdline()) for p in children), [p.cmdline() for p in children]
    os.kill(proc.pid, sig)
    err = _stopped(proc, lines, seen, children)
    _assert_interrupted(proc.returncode, err)


@pytest.mark.timeout(420)
def test_ctrl_c_in_a_terminal_stops_the_demo_as_interrupted() -> None:
    """A terminal's Ctrl-C: SIGINT to the whole foreground process group. The demo's redis-server lives in a
    session of its own, so it is stopped last, by the demo, after the workers that use it."""
    proc, lines = _start_demo(None)
    seen = _until_line(proc, lines, READY_LINE)
    children = _children(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)
    err = _stopped(proc, lines, seen, children)
    _assert_interrupted(proc.returncode, err)
    assert "Redis" not in err.split(READY_LINE, 1)[1], err[-3000:]
