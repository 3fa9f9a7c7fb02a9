"""Write ``constraints.txt``: every package of this environment at its installed version (pip constraints).

``make`` and CI install with ``pip install -c constraints.txt -e ".[dev,bench]"``, so a fresh machine
gets the versions the test suite ran, not whatever the index holds that day. Regenerate after a
deliberate upgrade, once the tests pass on it::

    make constraints                      # = .venv/bin/python -m tools.lock_constraints

Constraints only cap versions; they never add a package, so one file serves the CPU and GPU
installs (``FLEET_ORT=gpu`` brings ``onnxruntime-gpu``, which is not pinned here). The project
itself (an editable install) is left out. The file is refused when celery or kombu lies outside
the range the worker accepts (:data:`broker.TESTED`).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from broker import TESTED, untested

__all__ = ["freeze", "main", "render"]

ROOT = Path(__file__).resolve().parents[1]
HEADER = """\
# Pip constraints: the versions `make test` and CI ran. Install with
#   pip install -c constraints.txt -e ".[dev,bench]"
# Regenerate from a tested environment with `make constraints` (python -m tools.lock_constraints).
# Python {python}.
"""


def freeze(python: str = sys.executable) -> list[str]:
    """``name==version`` of every distribution installed for ``python`` except editable installs, sorted."""
    out = subprocess.run([python, "-m", "pip", "freeze", "--exclude-editable", "--disable-pip-version-check"],
                         capture_output=True, text=True, check=True, timeout=120).stdout  # fmt: skip
    pins = [line.strip() for line in out.splitlines() if "==" in line and not line.startswith("#")]
    return sorted(pins, key=lambda line: line.split("==")[0].lower())


def render(pins: list[str], python_version: str) -> str:
    """The file's text (pure).

    Raises:
        SystemExit: celery or kombu is missing or outside :data:`TESTED` (the file would pin an untested one).
    """
    versions = {line.split("==")[0].lower(): line.split("==")[1] for line in pins}
    bad = untested({dist: versions.get(dist, "not installed") for dist in TESTED})
    if bad:
        raise SystemExit(f"refusing to lock untested {', '.join(bad)}: move broker.TESTED (broker/versions.py) and "
                         "setup.py's pins first, once the tests pass on it")
    return HEADER.format(python=python_version) + "\n".join(pins) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "constraints.txt")
    args = parser.parse_args(argv)
    text = render(freeze(), f"{sys.version_info.major}.{sys.version_info.minor}")
    args.out.write_text(text)
    print(f"wrote {args.out} ({text.count('==')} packages)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
