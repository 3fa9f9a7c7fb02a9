"""What ``pip install`` puts in an environment: exactly one ONNX Runtime build, chosen by FLEET_ORT.

pip builds the package metadata the way a user's install does (an isolated build with setuptools from
PyPI) and reports it without installing anything; the worker names the build it actually imported and
refuses a module folder that mixes both builds' files (tests/gpu_wheel shows both cases with the real wheel).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from broker.versions import TESTED, installed_versions, untested
from tools.lock_constraints import freeze
from workers import engine

ROOT = Path(__file__).resolve().parents[2]


def _base_requirements(tmp_path: Path, flavour: str | None) -> list[str]:
    """``Requires-Dist`` lines without an extra marker, as pip resolves them for ``pip install .``."""
    env = {k: v for k, v in os.environ.items() if k != "FLEET_ORT"}
    if flavour is not None:
        env["FLEET_ORT"] = flavour
    report = tmp_path / f"report-{flavour}.json"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--quiet", "--report", str(report),
         str(ROOT)],
        check=True, env=env, timeout=300, cwd=tmp_path)  # fmt: skip
    requires = json.loads(report.read_text())["install"][0]["metadata"]["requires_dist"]
    return [r for r in requires if "extra ==" not in r]


@pytest.mark.parametrize(
    ("flavour", "expected"),
    [(None, ["onnxruntime"]), ("gpu", ["onnxruntime-gpu"]), ("none", [])],
)
def test_the_base_install_brings_exactly_one_ort_build(tmp_path: Path, flavour: str | None,
                                                        expected: list[str]) -> None:
    requires = _base_requirements(tmp_path, flavour)
    names = [re.match(r"[A-Za-z0-9_.-]+", r).group(0) for r in requires]  # type: ignore[union-attr]
    assert [n for n in names if n.startswith("onnxruntime")] == expected
    assert "celery" in names and "pydantic" in names
    # celery and kombu are pinned to the range the worker accepts at start (broker.versions)
    pins = {n: r[len(n):].split(";")[0].strip() for n, r in zip(names, requires, strict=True)}
    assert {d: str(SpecifierSet(pins[d].removeprefix("[redis]"))) for d in TESTED} == {
        d: str(SpecifierSet(s)) for d, s in TESTED.items()}


def test_an_unknown_ort_build_is_refused_with_the_choices(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", str(ROOT)],
        env={**os.environ, "FLEET_ORT": "rocm"}, capture_output=True, text=True, timeout=300, cwd=tmp_path)  # fmt: skip
    assert proc.returncode != 0
    expected = "FLEET_ORT='rocm' is not an ONNX Runtime build; use one of ['cpu', 'gpu', 'none']"
    assert expected in proc.stdout + proc.stderr


def test_this_environment_reports_its_one_build() -> None:
    import onnxruntime

    # named from the imported files: package, version, folder (tests/gpu_wheel: both builds' metadata)
    expected = f"onnxruntime {onnxruntime.__version__} from {Path(onnxruntime.__file__).parent}, providers "
    assert engine.check_single_ort_build().startswith(expected)


def test_the_lock_file_pins_what_this_environment_runs() -> None:
    """constraints.txt (what make and CI install from) holds this environment's versions: a fresh
    ``pip install -c constraints.txt -e .[dev,bench]`` reproduces what the tests run on."""
    locked = {line.split("==")[0].lower(): line.split("==")[1]
              for line in (ROOT / "constraints.txt").read_text().splitlines() if "==" in line and line[0] != "#"}
    assert untested({d: locked.get(d, "not installed") for d in TESTED}) == []
    assert {d: locked[d] for d in TESTED} == installed_versions()
    here = {line.split("==")[0].lower(): line.split("==")[1] for line in freeze()}
    drift = {name: (version, here.get(name)) for name, version in locked.items() if here.get(name) != version}
    assert not drift, f"locked vs installed {drift}: run `make constraints` after a deliberate upgrade, or reinstall"
