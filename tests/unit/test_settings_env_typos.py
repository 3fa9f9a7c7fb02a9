"""A ``FLEET_*`` variable that names no setting is said, once, with the name it most likely meant:
pydantic-settings ignores it, so ``FLEET_WORKER_CONCURRENCY=4`` (one underscore) silently left 16 tokens."""

from __future__ import annotations

import logging

import pytest

from protocol import settings as settings_module
from protocol.settings import load_settings


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(settings_module, "_warned_env", set())


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
