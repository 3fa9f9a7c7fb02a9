"""pip installs for the test tiers that build their own virtual environment (gpu_wheel/, optimum/).

Those tiers need packages from the package index. Without it (offline, a firewall, an index that
does not answer) they SKIP with the reason; any other install failure (a version conflict, a broken
wheel) is an error of the test, shown with pip's output.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

__all__ = ["NETWORK_MARKERS", "network_failure", "pip_install_or_skip"]

NETWORK_MARKERS = (
    "NewConnectionError",
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "Name or service not known",
    "Network is unreachable",
    "Connection refused",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "Max retries exceeded",
    "ProxyError",
    "(from versions: none)",
)
"""pip output that says the index could not be reached (the last one: nothing was listed at all)."""


def network_failure(pip_output: str) -> str | None:
    """The line of ``pip_output`` that shows the package index was unreachable, else None (pure)."""
    lines = pip_output.splitlines()
    for marker in NETWORK_MARKERS:  # in order: a connection error says more than an empty listing
        for line in lines:
            if marker in line:
                return line.strip()
    return None


def pip_install_or_skip(
    python: Path | str,
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 900,
    local_only: Sequence[str] = (),
) -> None:
    """``python -m pip install -q *args``; skips the calling test when the index cannot be reached.

    A pip that is still running after ``timeout_s`` seconds counts as an unreachable index too.
    ``local_only`` names requirements that only a wheel on this machine's disk provides (pip's
    find-links, e.g. ``torch==2.13.0+cpu``): a machine without it skips too, rather than letting
    pip fetch something else.

    Raises:
        pytest.skip.Exception: the failure is the network's (the reason quotes pip's line).
        pytest.fail.Exception: pip failed for another reason (its output's tail is shown).
    """
    cmd = [str(python), "-m", "pip", "install", "-q", *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                              env=dict(env) if env is not None else dict(os.environ))
    except subprocess.TimeoutExpired:
        pytest.skip(f"package index did not answer: pip install {' '.join(args)} still ran after {timeout_s:.0f} s")
    if proc.returncode == 0:
        return
    output = proc.stdout + proc.stderr
    line = network_failure(output)
    if line is not None:
        pytest.skip(f"package index unreachable, cannot pip install {' '.join(args)}: {line}")
    for req in local_only:
        if f"No matching distribution found for {req}" in output:
            pytest.skip(f"{req} is not on this machine (pip's find-links) and is not fetched from the index")
    pytest.fail(f"pip install {' '.join(args)} failed (exit {proc.returncode}):\n{output[-4000:]}")
