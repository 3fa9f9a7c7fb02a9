"""Pure pieces of the CLI's first-day answers: ``--tokens`` parsing, a closed stdout, the line for a ``FLEET_*``
variable that is not the JSON its setting takes, and which bind addresses only this machine reaches (the real
commands: tests/integration/test_first_day.py, test_first_day_cli_faces.py)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import pytest
from pydantic_settings import SettingsError

from producer.cli_errors import EXIT_STDOUT_CLOSED, run_command
from producer.cli_generation import parse_ids
from producer.ops_cli import _loopback_only
from protocol.errors import ConfigError, InvalidRequest
from protocol.settings import load_settings
from protocol.settings_env import settings_env_problem


@pytest.mark.parametrize(("raw", "ids"), [
    ("5,6,7", [5, 6, 7]),
    ("5, 6, 7", [5, 6, 7]),
    ("1 2 3", [1, 2, 3]),  # was [123]: the spaces were dropped inside an id
    (" 5 ,6\t7", [5, 6, 7]),
    ("12", [12]),
    ("-1", [-1]),  # out of any vocabulary: the request's own check says so
    ("", []),
    ("  ", []),
])
def test_token_ids(raw: str, ids: list[int]) -> None:
    assert parse_ids(raw, "--tokens", "input_ids") == ids


@pytest.mark.parametrize(("raw", "says"), [
    ("[5,6,7]", "item 1 is '[5'"),
    ("5;6", "item 1 is '5;6'"),
    ("5.0", "item 1 is '5.0'"),
    ("a", "item 1 is 'a'"),
    ("5,,6", "item 2 is empty"),  # ran as [5, 6]
    ("5,6,", "item 3 is empty"),  # a lost id, as in 5,,6
    (",5", "item 1 is empty"),
    ("5, 6 ,,7", "item 3 is empty"),
    ("5_0", "item 1 is '5_0'"),  # became 50
    ("５,６", "item 1 is '５'"),  # fullwidth digits read as 5, 6
    ("7, ٣", "item 2 is '٣'"),  # Arabic-Indic 3
    ("+5", "item 1 is '+5'"),
])  # fmt: skip
def test_token_ids_refused_name_the_flag_and_the_item(raw: str, says: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_ids(raw, "--tokens", "input_ids")
    assert info.value.field == "input_ids" and str(info.value).startswith("--tokens must be comma-separated integers")
    assert str(info.value).endswith(f": {says}"), str(info.value)


def test_stop_token_ids_are_read_alike() -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_ids("2,,3", "--stop-token-ids", "stop_token_ids")
    assert str(info.value).startswith("--stop-token-ids must be") and str(info.value).endswith("item 2 is empty")


def _prints(text: str) -> Callable[[argparse.Namespace], int]:
    def command(_: argparse.Namespace) -> int:
        print(text)
        return 0

    return command


@pytest.mark.parametrize("size", [100_000, 2])  # raised by the print itself; by the flush after the command
def test_a_closed_stdout_ends_a_command_with_141_and_no_message(
    size: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``fleet status | true``: "fleet: unexpected BrokenPipeError", exit 1 (the real command:
    tests/integration/test_first_day_cli_faces.py)."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader went away (| true, | head -1)
    with open(write_end, "w") as closed:
        monkeypatch.setattr(sys, "stdout", closed)
        assert run_command(_prints("x" * size), argparse.Namespace()) == EXIT_STDOUT_CLOSED
        print("buffered", file=closed)  # what is left goes to /dev/null now, not to a second BrokenPipeError
        closed.flush()
        monkeypatch.undo()
    assert capsys.readouterr().err == ""


def test_a_broken_pipe_other_than_stdout_is_a_failure(capsys: pytest.CaptureFixture[str]) -> None:
    def other_pipe(_: argparse.Namespace) -> int:
        raise BrokenPipeError(32, "Broken pipe")  # a child's stdin, say: stdout is fine

    assert run_command(other_pipe, argparse.Namespace()) == 1
    assert capsys.readouterr().err.startswith("fleet: unexpected BrokenPipeError")


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
