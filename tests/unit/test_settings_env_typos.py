"""A ``FLEET_*`` variable that names no setting is said, once, with the name it most likely meant:
pydantic-settings ignores it, so ``FLEET_WORKER_CONCURRENCY=4`` (one underscore) silently left 16 tokens."""

from __future__ import annotations

import ast
import logging
import os
import re
from pathlib import Path

import pytest

from protocol import settings as settings_module
from protocol.settings import load_settings


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """No warning said yet, and no ``FLEET_*`` variable left by the test process (an earlier test in the same
    worker may have run ``fleet worker``'s preflight, which marks the environment)."""
    monkeypatch.setattr(settings_module, "_warned_env", set())
    for var in list(os.environ):
        if var.upper().startswith("FLEET_"):
            monkeypatch.delenv(var)


def test_a_mistyped_variable_is_named_with_what_it_meant(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for var, value in {"FLEET_WORKER_CONCURRENCY": "4", "FLEET_RESULT_TTL": "5", "FLEET_BOGUS": "1",
                       "FLEET_DEBUG": "1", "FLEET_WORKER__CONCURRENCY": "8"}.items():  # fmt: skip
        monkeypatch.setenv(var, value)
    with caplog.at_level(logging.WARNING, logger="fleet.settings"):
        settings = load_settings()
        load_settings()  # said once per process
    said = sorted(r.getMessage() for r in caplog.records if r.name == "fleet.settings")
    assert said == [
        "environment variable FLEET_BOGUS is not a setting and is ignored",
        "environment variable FLEET_RESULT_TTL is not a setting and is ignored (did you mean FLEET_RESULT_TTL_S?)",
        "environment variable FLEET_WORKER_CONCURRENCY is not a setting and is ignored "
        "(did you mean FLEET_WORKER__CONCURRENCY?)",
    ]
    assert settings.worker.concurrency == 8  # the right spelling still applies


PRODUCT_CODE = ("broker", "bench", "gateway", "planner", "producer", "protocol", "store", "tools", "workers")
_FLEET_NAME = re.compile(r"^FLEET_[A-Z0-9_]*[A-Z0-9]$")


def _fleet_variables_the_code_names() -> set[str]:
    """Every whole ``FLEET_*`` string in the product's code, less the names exported in ``__all__`` (Python
    constants such as ``FLEET_TASK_PREFIX``) and prefixes (``FLEET_MODELS__``)."""
    root = Path(__file__).resolve().parents[2]
    names: set[str] = set()
    for package in PRODUCT_CODE:
        for path in (root / package).rglob("*.py"):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            exported = {c.value for node in ast.walk(tree) if isinstance(node, ast.Assign)
                        and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
                        for c in ast.walk(node.value) if isinstance(c, ast.Constant)}  # fmt: skip
            names |= {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
                      and isinstance(node.value, str) and _FLEET_NAME.match(node.value)} - exported  # fmt: skip
    return names


def test_no_variable_the_fleet_itself_sets_or_reads_is_called_a_typo(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``fleet worker`` marks its environment (``FLEET_REDIS_PREFLIGHT_PID``) before Celery loads the settings:
    every worker's log opened with "... is not a setting and is ignored" about the fleet's own variable."""
    names = _fleet_variables_the_code_names()
    assert {"FLEET_REDIS_PREFLIGHT_PID", "FLEET_CONFIG", "FLEET_WORKER__CONCURRENCY"} <= names  # the scan sees them
    for name in names:
        monkeypatch.setenv(name, "1")
    with caplog.at_level(logging.WARNING, logger="fleet.settings"):
        settings_module._warn_unknown_env()
    assert [r.getMessage() for r in caplog.records if r.name == "fleet.settings"] == []
