"""The test tiers that build their own virtual environment (gpu_wheel/, guidellm/, optimum/, genai/).

The venvs themselves are :mod:`tools.tier_venvs` (shared with the bench pages). Without the package
index (offline, a firewall, an index that does not answer) a tier SKIPS with the reason; any other
install failure (a version conflict, a broken wheel) is an error of the test, shown with pip's output.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from tools.tier_venvs import TIERS, IndexUnreachable, Tier, TierBuildFailed, build_tier, pip_install

__all__ = ["TIERS", "ensure_venv", "pip_install_or_skip"]


def ensure_venv(tier: Tier) -> Path:
    """``tier``'s venv python (:func:`tools.tier_venvs.build_tier`); skips the calling test when the index
    cannot be reached, fails it when pip fails otherwise."""
    try:
        return build_tier(tier)
    except IndexUnreachable as exc:
        pytest.skip(str(exc))
    except TierBuildFailed as exc:
        pytest.fail(str(exc))


def pip_install_or_skip(python: Path | str, args: Sequence[str], *, env: Mapping[str, str] | None = None,
                        timeout_s: float = 900, local_only: Sequence[str] = ()) -> None:  # fmt: skip
    """:func:`tools.tier_venvs.pip_install`, with the same skip (no index) or failure (anything else)."""
    try:
        pip_install(python, args, env=env, timeout_s=timeout_s, local_only=local_only)
    except IndexUnreachable as exc:
        pytest.skip(str(exc))
    except TierBuildFailed as exc:
        pytest.fail(str(exc))
