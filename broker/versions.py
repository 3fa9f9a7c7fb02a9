"""The celery and kombu versions the fleet was tested with, and the worker's start-up check.

The worker adapts kombu's and Celery's internals: it subclasses kombu's Redis ``Channel`` and
``QoS`` and overrides private methods (``_brpop_start``, ``_brpop_read``, ``_remove_from_indices``, …),
wraps Celery's tracer and its event dispatcher. None of that is a public API: a new minor release
may rename or reorder it, and the failure would be silent (a lost message, a never-acked one), not
an import error. So the install pins both to the minor versions the test suite ran
(``setup.py``, ``constraints.txt``), and a worker refuses to start on any other, with the reason.

``worker.allow_untested_kombu`` (``FLEET_WORKER__ALLOW_UNTESTED_KOMBU=1``) lets it start anyway,
logged as a warning on every start: for trying a new release before the pins move.
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Mapping

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from protocol.errors import ConfigError

__all__ = ["OVERRIDE_ENV", "TESTED", "check_broker_versions", "installed_versions", "untested"]

log = logging.getLogger("fleet.worker")

TESTED: Mapping[str, str] = {"celery": ">=5.7,<5.8", "kombu": ">=5.7,<5.8"}
"""Distribution -> the version range the tests ran (must match ``setup.py``'s pins; a test checks it)."""

OVERRIDE_ENV = "FLEET_WORKER__ALLOW_UNTESTED_KOMBU"
"""The environment variable of the ``worker.allow_untested_kombu`` setting."""

WHY = ("the worker overrides private methods of kombu's Redis channel and QoS (_brpop_start, _brpop_read, "
       "_connparams, _remove_from_indices, …) and wraps Celery's tracer, so a release outside the tested range "
       "may lose or never ack messages without an error")


def installed_versions() -> dict[str, str]:
    """The installed version of each distribution in :data:`TESTED` ("not installed" when absent)."""
    out = {}
    for dist in TESTED:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def untested(versions: Mapping[str, str], tested: Mapping[str, str] = TESTED) -> list[str]:
    """``"kombu 5.6.2 (tested: >=5.7,<5.8)"`` for each version outside its tested range (pure).

    A pre-release or an unparsable version is outside every range.
    """
    out = []
    for dist, spec in tested.items():
        raw = versions.get(dist, "not installed")
        try:
            inside = SpecifierSet(spec).contains(Version(raw), prereleases=False)
        except InvalidVersion:
            inside = False
        if not inside:
            out.append(f"{dist} {raw} (tested: {spec})")
    return out


def check_broker_versions(allow_untested: bool, versions: Mapping[str, str] | None = None) -> list[str]:
    """Refuse versions outside the tested ranges unless ``allow_untested``; returns the untested ones.

    Raises:
        ConfigError: a version is outside its tested range and ``allow_untested`` is false (the message
            names the versions, the ranges, why, and how to install the tested ones or override).
    """
    found = untested(installed_versions() if versions is None else versions)
    if not found:
        return []
    listed = ", ".join(found)
    if not allow_untested:
        raise ConfigError(
            f"untested {listed}: {WHY}. Install the tested versions (pip install -c constraints.txt -e .), "
            f"or set {OVERRIDE_ENV}=1 to start anyway at your own risk",
            "worker.allow_untested_kombu",
            dict(TESTED),
        )
    log.warning("starting on untested %s because worker.allow_untested_kombu is set: %s", listed, WHY)
    return found
