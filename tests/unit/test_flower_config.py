"""``fleet flower``'s Flower options and its ``--conf`` file: checked against the installed Flower."""

from __future__ import annotations

import copy
import json
import types
from pathlib import Path

import pytest
from celery.events.state import Task
from celery.utils.saferepr import saferepr

from producer import flower_config
from producer.flower_config import MAX_SHOWN_CHARS, as_json, format_task
from producer.ops_cli import FLOWER_DB, FLOWER_TASKS_COLUMNS, flower_command
from producer.reprs import request_argsrepr
from protocol.messages import InferenceRequest
from protocol.settings import FleetSettings

RESULT = {
    "schema_version": 1,
    "request_id": "hello-1",
    "model": "demo-lm",
    "kind": "next_token",
    "top_k": [{"token_id": 337, "logprob": -1.2460590600967407}],
    "embedding": None,
    "generation": None,
    "truncated": False,
    "timings": {"queue_wait_ms": 91.011, "worker": "demo-lm@node-1"},
}
CUT_REPR = saferepr({"embedding": [0.123456789 * i for i in range(300)]}, 1024)
"""A result repr Celery cut at 1,024 characters: not a literal any more."""


def _args_json() -> str:
    request = InferenceRequest(model="demo-lm", input_ids=[75, 104, 111], request_id="hello-1")
    return request_argsrepr(request, "Héllo")


@pytest.mark.parametrize(
    ("shown", "expected"),
    [
        (None, None),
        ("", ""),
        ("{}", "{}"),
        ("'hello'", '"hello"'),  # Celery's repr of a str result
        ("None", "null"),
        ("{'a': None, 'b': True, 'c': (1, 2)}", '{"b": true, "c": [1, 2], "a": null}'),
        ("[{'text': 'x', 'model': 'm', 'input_ids': [1]}]", '[{"text": "x", "input_ids": [1], "model": "m"}]'),
        # left as they are: not a literal, NaN, a set, a repr Celery cut short
        ("<object object at 0x7f>", "<object object at 0x7f>"),
        ("{'x': nan}", "{'x': nan}"),
        ("{1, 2}", "{1, 2}"),
        ("{'a': 'xx...'}", '{"a": "xx..."}'),
        (CUT_REPR, CUT_REPR),
    ],
)
def test_as_json_table(shown: str | None, expected: str | None) -> None:
    assert as_json(shown) == expected


def test_result_repr_becomes_the_same_json_with_outputs_first() -> None:
    shown = as_json(saferepr(RESULT, 1024))
    assert shown is not None
    assert json.loads(shown) == RESULT
    assert list(json.loads(shown)) == [
        "top_k", "model", "kind", "truncated", "timings", "embedding", "generation", "request_id", "schema_version"
    ]  # fmt: skip


def test_producer_args_keep_their_content_with_text_and_ids_first() -> None:
    shown = as_json(_args_json())
    assert shown is not None and json.loads(shown) == json.loads(_args_json())
    (doc,) = json.loads(shown)
    assert list(doc)[:2] == ["text", "input_ids"] and doc["text"] == "Héllo" and list(doc)[-1] == "schema_version"
    assert "Héllo" in shown  # not \\u-escaped


def test_long_json_is_cut_to_the_limit() -> None:
    shown = as_json(json.dumps({"text": "x" * 5000}))
    assert shown is not None and len(shown) == MAX_SHOWN_CHARS and shown.endswith("…")
    assert as_json(repr(list(range(30))), max_chars=20) == "[0, 1, 2, 3, 4, 5, …"


def test_format_task_on_a_celery_task_copy_as_flower_passes_it() -> None:
    task = Task(uuid="hello-1", args=_args_json(), kwargs="{}", result=saferepr(RESULT, 1024), state="SUCCESS")
    shown = format_task(copy.copy(task))
    assert json.loads(shown.result) == RESULT and json.loads(shown.args) == json.loads(_args_json())
    assert shown.kwargs == "{}" and shown.uuid == "hello-1"
    assert task.result == saferepr(RESULT, 1024)  # the stored task is untouched
    failed = format_task(Task(uuid="late-1", args="[]", result=None, exception="RequestExpired('late', 'x', 1)"))
    assert failed.result is None and failed.exception == "RequestExpired('late', 'x', 1)"


def test_config_file_sets_only_format_task_as_flower_reads_it() -> None:
    from flower.options import default_options

    path = Path(flower_config.__file__)
    namespace: dict[str, object] = {"__file__": str(path)}
    exec(compile(path.read_text(), str(path), "exec"), namespace, namespace)  # what tornado's parse_config_file does
    option_names = {name.replace("-", "_") for name in default_options._options}
    assert {name for name in namespace if name.replace("-", "_") in option_names} == {"format_task"}
    assert isinstance(namespace["format_task"], types.FunctionType)


def test_flower_command_options_are_flower_options_and_secrets_stay_in_env(tmp_path: Path) -> None:
    from flower.command import is_flower_option
    from flower.views.tasks import TASK_COLUMNS

    settings = FleetSettings(
        redis_url="redis://:redis-secret@127.0.0.1:6379/0", flower={"basic_auth": ["ops:pw-secret"], "port": 5599}
    )
    cmd, env = flower_command(settings, None, None, tmp_path / "f.db")
    assert cmd[1:4] == ["-m", "producer.flower_main", "flower"]
    options = dict(arg.removeprefix("--").split("=", 1) for arg in cmd[4:])
    assert all(is_flower_option(arg) for arg in cmd[4:])
    assert options == {
        "address": "127.0.0.1",
        "port": "5599",
        "conf": str(Path(flower_config.__file__).resolve()),
        "tasks_columns": ",".join(FLOWER_TASKS_COLUMNS),
        "persistent": "True",
        "db": str((tmp_path / "f.db").resolve()),
        "state_save_interval": "10000",
    }
    assert set(FLOWER_TASKS_COLUMNS) <= set(TASK_COLUMNS) and {"args", "result"} <= set(FLOWER_TASKS_COLUMNS)
    assert not any("secret" in arg for arg in cmd)
    assert env["FLOWER_BASIC_AUTH"] == "ops:pw-secret" and env["CELERY_BROKER_URL"] == settings.redis_url
    default_cmd, _ = flower_command(settings, "0.0.0.0", 6000)
    assert f"--db={FLOWER_DB.resolve()}" in default_cmd and "--address=0.0.0.0" in default_cmd
