"""The test tiers that build their own virtual environment (gpu_wheel/, guidellm/, optimum/).

Those tiers need packages from the package index. Without it (offline, a firewall, an index that
does not answer) they SKIP with the reason; any other install failure (a version conflict, a broken
wheel) is an error of the test, shown with pip's output.

Each tier's venv is described once here (:data:`TIERS`) and built by :func:`ensure_venv` under a file
lock, so ``python -m tests.tier_venv prebuild`` (what ``.ci/run`` starts in the background while the
linters run) and a test's fixture never build one at the same time: the fixture waits for the build
in progress and reuses it. A venv is reused while its pins stay the same (a marker file names them).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import time
import venv
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

__all__ = ["NETWORK_MARKERS", "TIERS", "Tier", "ensure_venv", "network_failure", "pip_install_or_skip"]

ROOT = Path(__file__).resolve().parents[1]
TORCH_CPU = "torch==2.13.0+cpu"
"""The CPU wheel on this machine's disk (pip's find-links); any other torch would download CUDA."""
ORT_GPU = "onnxruntime-gpu==1.31.1"


@dataclass(frozen=True)
class Tier:
    """One tier's virtual environment: where, what pip installs there, and with which environment."""

    name: str
    pins: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment of the pip run (e.g. ``FLEET_ORT=gpu``)."""
    local_only: tuple[str, ...] = ()
    timeout_s: float = 600

    @property
    def venv(self) -> Path:
        return ROOT / "var" / f"{self.name}-venv"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def marker(self) -> Path:
        pinned = " ".join([*self.pins, *(f"{k}={v}" for k, v in sorted(self.env.items()))])
        return self.venv / f".ready-{hashlib.sha256(pinned.encode()).hexdigest()[:16]}"


TIERS = {
    "optimum": Tier("optimum", (TORCH_CPU, "transformers==4.57.6", "optimum==2.1.0", "optimum-onnx==0.1.0",
                                "onnx==1.23.2", "onnxruntime==1.31.1"), local_only=(TORCH_CPU,)),
    "guidellm": Tier("guidellm", (TORCH_CPU, "guidellm==0.8.1"), local_only=(TORCH_CPU,)),
    # the documented GPU install: FLEET_ORT=gpu makes setup.py depend on onnxruntime-gpu instead
    "ort-gpu": Tier("ort-gpu", ("-e", f"{ROOT}[gpu]", ORT_GPU), env={"FLEET_ORT": "gpu"}, timeout_s=900),
}
"""optimum-onnx 0.1.0 needs optimum ~=2.1.0 and transformers <4.58."""


@contextmanager
def _locked(tier: Tier) -> Iterator[None]:
    lock = ROOT / "var" / f".{tier.name}-venv.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # a build in progress elsewhere: wait for it
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_venv(tier: Tier) -> Path:
    """``tier``'s venv python, built first unless its marker says it holds ``tier.pins`` (skips or
    fails the calling test as :func:`pip_install_or_skip` says)."""
    with _locked(tier):
        if not tier.marker.exists():
            venv.EnvBuilder(with_pip=True, clear=True).create(tier.venv)
            pip_install_or_skip(tier.python, tier.pins, env={**os.environ, **tier.env}, timeout_s=tier.timeout_s,
                                local_only=tier.local_only)  # fmt: skip
            tier.marker.touch()
    return tier.python


def prebuild() -> int:
    """Build every tier's venv at once (``python -m tests.tier_venv prebuild``); a line per tier. Always 0:
    a tier that could not be built is built (or skipped, with its reason) by its tests."""

    def one(tier: Tier) -> str:
        started = time.monotonic()
        try:
            ensure_venv(tier)
        except BaseException as exc:  # pytest's skip/fail outcomes are BaseException: say it, leave it to the tests
            return f"{tier.name}: not built ({type(exc).__name__}: {str(exc)[:300]})"
        return f"{tier.name}: ready in {time.monotonic() - started:.0f} s ({tier.venv})"

    with ThreadPoolExecutor(len(TIERS)) as pool:
        for line in pool.map(one, TIERS.values()):
            print(f"tier venv {line}", flush=True)
    return 0

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


if __name__ == "__main__":
    if sys.argv[1:] != ["prebuild"]:
        sys.exit("usage: python -m tests.tier_venv prebuild")
    sys.exit(prebuild())
