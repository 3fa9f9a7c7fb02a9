"""The virtual environments of the tiers that need packages the fleet does not (optimum, guidellm,
the GPU wheel, onnxruntime-genai), shared by their tests and the bench pages that run them.

Each tier's venv is described once (:data:`TIERS`) and built by :func:`build_tier` under a file lock,
so ``python -m tools.tier_venvs prebuild`` (what ``.ci/run`` starts in the background while the
linters run), a test's fixture and a bench page never build one at the same time: the second waits
for the build in progress and reuses it. A venv is reused while its pins stay the same (a marker file
names them). The tests turn :class:`IndexUnreachable` into a skip (``tests/tier_venv.py``).
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

__all__ = ["NETWORK_MARKERS", "TIERS", "IndexUnreachable", "Tier", "TierBuildFailed", "build_tier",
           "network_failure", "pip_install"]  # fmt: skip

ROOT = Path(__file__).resolve().parents[1]
TORCH_CPU = "torch==2.13.0+cpu"
"""The CPU wheel on this machine's disk (pip's find-links); any other torch would download CUDA."""
ORT_GPU = "onnxruntime-gpu==1.31.1"


class IndexUnreachable(RuntimeError):
    """pip could not reach the package index (offline, a firewall, no answer in time), or a
    requirement only this machine's disk provides is missing: the tier cannot be built here."""


class TierBuildFailed(RuntimeError):
    """pip failed for another reason (a version conflict, a broken wheel); the message ends with its output."""


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
    # optimum-onnx 0.1.0 needs optimum ~=2.1.0 and transformers <4.58
    "optimum": Tier("optimum", (TORCH_CPU, "transformers==4.57.6", "optimum==2.1.0", "optimum-onnx==0.1.0",
                                "onnx==1.23.2", "onnxruntime==1.31.1"), local_only=(TORCH_CPU,)),
    "guidellm": Tier("guidellm", (TORCH_CPU, "guidellm==0.8.1"), local_only=(TORCH_CPU,)),
    # the documented GPU install: FLEET_ORT=gpu makes setup.py depend on onnxruntime-gpu instead
    "ort-gpu": Tier("ort-gpu", ("-e", f"{ROOT}[gpu]", ORT_GPU), env={"FLEET_ORT": "gpu"}, timeout_s=900),
    # onnxruntime-genai's model builder (it imports transformers' newest model classes, hence 5.x) and og.Engine
    "genai": Tier("genai", (TORCH_CPU, "transformers==5.25.0", "onnx==1.23.2", "onnx-ir==1.1.0",
                            "onnxruntime==1.31.1", "onnxruntime-genai==0.18.0"), local_only=(TORCH_CPU,)),
}


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


def build_tier(tier: Tier) -> Path:
    """``tier``'s venv python, built first unless its marker says it holds ``tier.pins``.

    Raises:
        IndexUnreachable: the package index (or a local-only wheel) is not there.
        TierBuildFailed: pip failed for another reason.
    """
    with _locked(tier):
        if not tier.marker.exists():
            venv.EnvBuilder(with_pip=True, clear=True).create(tier.venv)
            pip_install(tier.python, tier.pins, env={**os.environ, **tier.env}, timeout_s=tier.timeout_s,
                        local_only=tier.local_only)  # fmt: skip
            tier.marker.touch()
    return tier.python


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


def pip_install(python: Path | str, args: Sequence[str], *, env: Mapping[str, str] | None = None,
                timeout_s: float = 900, local_only: Sequence[str] = ()) -> None:  # fmt: skip
    """``python -m pip install -q *args``.

    A pip still running after ``timeout_s`` seconds counts as an unreachable index. ``local_only``
    names requirements that only a wheel on this machine's disk provides (pip's find-links, e.g.
    ``torch==2.13.0+cpu``): a machine without it cannot build the tier, rather than letting pip
    fetch something else.

    Raises:
        IndexUnreachable: the failure is the network's, or a local-only wheel is missing (the
            message quotes pip's line).
        TierBuildFailed: pip failed for another reason (its output's tail is in the message).
    """
    cmd = [str(python), "-m", "pip", "install", "-q", *args]
    wanted = " ".join(args)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                              env=dict(env) if env is not None else dict(os.environ))
    except subprocess.TimeoutExpired as exc:
        raise IndexUnreachable(f"package index did not answer: pip install {wanted} still ran after "
                               f"{timeout_s:.0f} s") from exc  # fmt: skip
    if proc.returncode == 0:
        return
    output = proc.stdout + proc.stderr
    line = network_failure(output)
    if line is not None:
        raise IndexUnreachable(f"package index unreachable, cannot pip install {wanted}: {line}")
    for req in local_only:
        if f"No matching distribution found for {req}" in output:
            raise IndexUnreachable(f"{req} is not on this machine (pip's find-links) and is not fetched from the index")
    raise TierBuildFailed(f"pip install {wanted} failed (exit {proc.returncode}):\n{output[-4000:]}")


def prebuild() -> int:
    """Build every tier's venv at once (``python -m tools.tier_venvs prebuild``); a line per tier. Always 0:
    a tier that could not be built is built (or skipped, with its reason) by its tests."""

    def one(tier: Tier) -> str:
        started = time.monotonic()
        try:
            build_tier(tier)
        except (IndexUnreachable, TierBuildFailed, OSError) as exc:  # said here, left to the tests
            return f"{tier.name}: not built ({type(exc).__name__}: {str(exc)[:300]})"
        return f"{tier.name}: ready in {time.monotonic() - started:.0f} s ({tier.venv})"

    with ThreadPoolExecutor(len(TIERS)) as pool:
        for line in pool.map(one, TIERS.values()):
            print(f"tier venv {line}", flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:] != ["prebuild"]:
        sys.exit("usage: python -m tools.tier_venvs prebuild")
    sys.exit(prebuild())
