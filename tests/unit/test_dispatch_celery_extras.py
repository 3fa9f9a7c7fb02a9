"""Celery's per-task extras follow settings.celery (defaults keep Flower's events)."""

from __future__ import annotations

from pathlib import Path

import pytest

from protocol.celeryconf import celery_config
from protocol.errors import ConfigError
from protocol.settings import FleetSettings, load_settings


def test_defaults_keep_flowers_events_and_drop_started_and_extended_results() -> None:
    conf = celery_config(FleetSettings())
    assert conf["worker_send_task_events"] is True and conf["task_send_sent_event"] is True
    assert conf["task_track_started"] is False  # workers store STARTED for generations only
    assert conf["result_extended"] is False


def _empty_config(tmp_path: Path) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text("{}\n")
    return path


def test_each_extra_is_a_setting(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FLEET_CELERY__TASK_EVENTS", "false")
    monkeypatch.setenv("FLEET_CELERY__SENT_EVENTS", "false")
    monkeypatch.setenv("FLEET_CELERY__TRACK_STARTED", "true")
    monkeypatch.setenv("FLEET_CELERY__RESULT_EXTENDED", "true")
    conf = celery_config(load_settings(_empty_config(tmp_path)))
    assert conf["worker_send_task_events"] is False and conf["task_send_sent_event"] is False
    assert conf["task_track_started"] is True
    assert conf["result_extended"] is True


def test_a_misspelt_extra_is_refused_by_name(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FLEET_CELERY__TASK_EVENT", "false")
    with pytest.raises(ConfigError, match="task_event"):
        load_settings(_empty_config(tmp_path))
