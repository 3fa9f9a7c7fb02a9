"""Real workers on other celery / kombu releases: refused outside the tested range, serving at both ends of it.

Each release runs in an overlay environment under ``var/broker-range/``: a virtual environment whose
own site-packages holds only that celery and kombu (``pip install --no-deps``), in front of this
environment's packages (a ``.pth`` adds them after its own). The worker subprocess imports the
overlay's celery and kombu (checked with the overlay's interpreter); reinstalling the whole project
per release would take minutes. Building one overlay takes seconds from the package index (kombu
5.6.2, the release just below the range, is also on this machine's local index).
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from broker.versions import OVERRIDE_ENV, TESTED
from tests.integration.fleet_fixtures import Fleet
from tests.tier_venv import pip_install_or_skip

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = ROOT / "var" / "broker-range"
BELOW_RANGE_KOMBU = "5.6.2"
"""The newest kombu below the tested range (its minor version is the one before)."""


def _lower_bound(spec: str) -> str:
    """``">=5.7,<5.8"`` -> ``"5.7.0"``: the oldest release the range admits (its first patch release)."""
    low = next(part[2:] for part in spec.split(",") if part.startswith(">="))
    return low if low.count(".") == 2 else f"{low}.0"


def overlay(name: str, requirements: list[str]) -> tuple[str, dict[str, str]]:
    """An overlay environment holding ``requirements`` (built once, reused); its python and
    ``{"celery": (version, file), "kombu": ...}`` as that python imports them."""
    home = OVERLAYS / name
    python = home / "bin" / "python"
    marker = home / ".ready"
    if not marker.exists():
        venv.EnvBuilder(with_pip=False, clear=True).create(home)
        site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   capture_output=True, text=True, check=True).stdout.strip())  # fmt: skip
        pip_install_or_skip(sys.executable, ["--no-deps", "--no-compile", "--target", str(site), *requirements],
                            timeout_s=300)  # fmt: skip
        # this environment's packages after the overlay's own (addsitedir also runs their .pth: the editable install)
        main_site = sysconfig.get_paths()["purelib"]
        (site / "zz_fleet_main_env.pth").write_text(f"import site; site.addsitedir({main_site!r})\n")
        marker.write_text(json.dumps(requirements))
    probe = subprocess.run(
        [str(python), "-c", "import json, celery, kombu; print(json.dumps({'celery': [celery.__version__, "
         "celery.__file__], 'kombu': [kombu.__version__, kombu.__file__]}))"],
        capture_output=True, text=True, check=True, timeout=120, cwd=ROOT)  # fmt: skip
    found = json.loads(probe.stdout)
    for dist, (_version, file) in found.items():
        assert Path(file).is_relative_to(home), f"{dist} imported from {file}, not from the overlay {home}"
    return str(python), {dist: version for dist, (version, _file) in found.items()}


@pytest.fixture(scope="module")
def below_range() -> tuple[str, dict[str, str]]:
    """This environment's celery with the kombu just below the range."""
    celery_version = _installed("celery")
    return overlay(f"celery-{celery_version}-kombu-{BELOW_RANGE_KOMBU}",
                   [f"celery=={celery_version}", f"kombu=={BELOW_RANGE_KOMBU}"])


def _installed(dist: str) -> str:
    import importlib.metadata

    return importlib.metadata.version(dist)


def test_a_worker_refuses_a_kombu_outside_the_tested_range(
    fleet: Fleet, below_range: tuple[str, dict[str, str]]
) -> None:
    python, versions = below_range
    assert versions["kombu"] == BELOW_RANGE_KOMBU
    worker = fleet.worker(fleet.config(), python=python, wait=False)
    assert worker.proc is not None
    code = worker.proc.wait(120)
    log = worker.log_tail(20_000)
    print(f"\nkombu {BELOW_RANGE_KOMBU}: exit {code}: {next(x for x in log.splitlines() if 'cannot start' in x)[:300]}")
    assert code == 3, log
    assert f"fleet worker: cannot start: untested kombu {BELOW_RANGE_KOMBU} (tested: {TESTED['kombu']})" in log
    assert "overrides private methods of kombu's Redis channel" in log  # the reason
    assert f"{OVERRIDE_ENV}=1" in log and "pip install -c constraints.txt" in log  # the ways out
    assert "Traceback" not in log


def test_the_override_starts_it_with_a_warning(fleet: Fleet, below_range: tuple[str, dict[str, str]]) -> None:
    python, _ = below_range
    cfg = fleet.config(worker={"allow_untested_kombu": True})
    worker = fleet.worker(cfg, python=python)  # waits until ready
    log = worker.log_tail(200_000)
    assert f"starting on untested kombu {BELOW_RANGE_KOMBU} (tested: {TESTED['kombu']})" in log
    assert "because worker.allow_untested_kombu is set" in log
    client = fleet.client(cfg)
    result = client.result(client.submit("demo-lm", [5, 6, 7], top_k=2), wait=True, timeout_s=60)
    assert result is not None and result.top_k is not None and result.timings.worker == worker.hostname


@pytest.mark.parametrize("end", ["oldest", "newest"])
def test_both_ends_of_the_tested_range_serve_a_request(fleet: Fleet, end: str) -> None:
    if end == "oldest":
        requirements = [f"{dist}=={_lower_bound(spec)}" for dist, spec in TESTED.items()]
        name = "-".join(r.replace("==", "-") for r in requirements)
    else:  # the newest releases the index offers in the range (resolved when the overlay is first built)
        requirements = [f"{dist}{spec}" for dist, spec in TESTED.items()]
        name = "newest-" + "-".join(f"{d}{s}" for d, s in TESTED.items()).replace(">=", "").replace(",<", "-")
    python, versions = overlay(name, requirements)
    print(f"\n{end} of the tested range: {versions}")
    worker = fleet.worker(fleet.config(), python=python)
    client = fleet.client(fleet.config())
    result = client.result(client.submit("demo-lm", [5, 6, 7], top_k=2), wait=True, timeout_s=60)
    assert result is not None and result.top_k is not None and len(result.top_k) == 2
    assert result.timings.worker == worker.hostname
    assert "untested" not in worker.log_tail(200_000)
