"""Pure pieces of the CLI's first-day answers: ``--tokens`` parsing, the line for a ``FLEET_*`` variable that is
not the JSON its setting takes, and which bind addresses only this machine reaches (the real commands:
tests/integration/test_first_day.py)."""

from __future__ import annotations

import pytest
from pydantic_settings import SettingsError

from producer.cli_generation import parse_ids
from producer.ops_cli import _loopback_only
from protocol.errors import ConfigError, InvalidRequest
from protocol.settings import load_settings
from protocol.settings_env import settings_env_problem


@pytest.mark.parametrize(("raw", "ids"), [
    ("5,6,7", [5, 6, 7]),
    ("5, 6, 7", [5, 6, 7]),
    ("1 2 3", [1, 2, 3]),  # was [123]: the spaces were dropped inside an id
    (" 5 ,6\t7,", [5, 6, 7]),
    ("12", [12]),
    ("", []),
])
def test_token_ids(raw: str, ids: list[int]) -> None:
    assert parse_ids(raw, "--tokens", "input_ids") == ids


@pytest.mark.parametrize("raw", ["[5,6,7]", "5;6", "5.0", "a"])
def test_token_ids_refused_name_the_flag_and_the_item(raw: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_ids(raw, "--tokens", "input_ids")
    assert info.value.field == "input_ids" and str(info.value).startswith("--tokens must be comma-separated integers")


def _problem(field: str, environ: dict[str, str]) -> str:
    error = SettingsError(f'error parsing value for field "{field}" from source "EnvSettingsSource"')
    return settings_env_problem(error, environ)[0]


@pytest.mark.parametrize(("field", "var", "value", "says"), [
    ("api", "FLEET_API__API_KEYS", "change-me", "this setting is a list"),
    ("api", "FLEET_API__API_KEYS", "['change-me']", "this setting is a list"),
    ("flower", "fleet_flower__basic_auth", "admin:pw", "this setting is a list"),  # names are case-insensitive
    ("models", "FLEET_MODELS__BENCH_LM__ENGINE__PROVIDERS", "CPUExecutionProvider", "this setting is a list"),
    ("models", "FLEET_MODELS__DEMO_LM__BATCHING", "{max_batch_size: 4}", "this setting is a section"),
    ("redis", "FLEET_REDIS", "{", "this setting is a section"),
])
def test_the_variable_that_is_not_json_is_named(field: str, var: str, value: str, says: str) -> None:
    environ = {"FLEET_API__PORT": "8000", "FLEET_MODELS__DEMO_LM__PATH": "m.onnx", var: value, "HOME": "/root"}
    line = _problem(field, environ)
    assert line.startswith(f"environment variable {var} is not valid JSON"), line
    assert says in line and f"{var}='" in line, line
    assert value not in line.split("e.g.")[0]  # never the value itself: it may be an API key or a password


def test_load_settings_raises_it_as_a_config_error_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every entry point (the CLI, FleetClient.from_settings, the gateway, a bare celery worker) loads settings
    through load_settings: it says the line as a ConfigError, never pydantic-settings' SettingsError."""
    monkeypatch.setenv("FLEET_API__API_KEYS", "change-me")
    with pytest.raises(ConfigError) as info:
        load_settings("/dev/null")
    assert info.value.field == "FLEET_API__API_KEYS" and "this setting is a list" in str(info.value)
    assert "change-me" not in str(info.value).split("e.g.")[0]


def test_scalars_and_valid_json_are_not_blamed() -> None:
    environ = {"FLEET_API__PORT": "80a", "FLEET_API__API_KEYS": '["ok"]'}  # 80a: pydantic's own error, elsewhere
    line = _problem("api", environ)
    assert line.startswith("a FLEET_API... environment variable could not be read"), line


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("192.0.2.1", False), ("10.0.0.5", False),
])
def test_loopback_only(host: str, loopback: bool) -> None:
    assert _loopback_only(host) is loopback
