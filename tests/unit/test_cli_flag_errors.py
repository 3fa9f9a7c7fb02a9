"""The ``fleet`` CLI refuses bad flags and bad files before anything runs: exit 2 and one line that names the
flag (or the setting, or the file) and the rule. No Redis: every case is refused before one is needed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from producer.cli import build_parser
from producer.cli import main as fleet_main
from producer.worker_celery_args import celery_args
from protocol.errors import ConfigError, ModelLoadError
from protocol.modelcard import load_card
from protocol.settings import EngineSettings, FleetSettings
from tools.build_lm import build_causal_lm
from workers.engine import serving_graph

DOWN = "redis://127.0.0.1:1/0"
"""A Redis nobody listens on: a case that reached Redis would fail with exit 1, not 2."""


@pytest.mark.parametrize(("argv", "says"), [
    (["api", "--port", "99999"], ["--port", "api.port", "<= 65535"]),
    (["api", "--port", "0"], ["--port", "api.port", ">= 1"]),  # 0 fell back to 8000
    (["flower", "--port", "0"], ["--port", "flower.port", ">= 1"]),
    (["worker", "--concurrency", "0"], ["--concurrency", "worker.concurrency", ">= 1 and <= 4096"]),
    (["demo", "--concurrency", "5000"], ["--concurrency", "worker.concurrency", "<= 4096"]),
    (["models", "compare", "demo-lm", "--window-s", "0"], ["--window-s", "canary.window_s", "> 0"]),
    (["redis", "--port", "99999"], ["--port", "from 0 to 65535"]),
    (["redis", "--port", "-5"], ["--port", "from 0 to 65535"]),
    (["store", "--port", "70000"], ["--port", "from 0 to 65535"]),
    (["models", "compare", "demo-lm", "--shadow", "x"], ["--shadow", "from 0 to 10000"]),
    (["models", "pin", "demo-lm", "1.2.3", "--wait-s", "nan"], ["--wait-s", "from 0 to 3600", "'nan'"]),
    (["models", "canary", "demo-lm", "1.2.3", "--weight", "5", "--wait-s", "-1"], ["--wait-s", "from 0 to 3600"]),
    (["models", "pin", "demo-lm", ""], ["argument version", "'' is not a valid name"]),  # was exit 1, a refused
    (["models", "canary", "demo-lm", " ", "--weight", "5"], ["argument version", "' ' is not a valid name"]),  # change
    (["models", "show", "demo-lm", "../x"], ["argument version", "'../x' is not a valid name"]),
    (["dead-letter", "purge", "--older-than", "x"], ["--older-than", "seconds >= 0"]),
    (["submit", "--model", "demo-lm", "--tokens", "5", "--wait", "--timeout", "-1"], ["--timeout", "from 0 to 86400"]),
    (["result", "r-1", "--wait", "--timeout", "-1"], ["--timeout", "from 0 to 86400"]),
    # fleet quantize: NaN passed the gate and reached the report; 0 divided by zero, stacked nothing, collected nothing
    (["quantize", "m.onnx", "--max-kl", "nan"], ["--max-kl", "finite number >= 0", "'nan'"]),
    (["quantize", "m.onnx", "--max-kl", "-1"], ["--max-kl", "finite number >= 0"]),
    (["quantize", "m.onnx", "--max-kl", "inf"], ["--max-kl", "finite number >= 0"]),
    (["quantize", "m.onnx", "--min-top1-agreement", "nan"], ["--min-top1-agreement", "from 0 to 1"]),
    (["quantize", "m.onnx", "--min-top1-agreement", "2"], ["--min-top1-agreement", "from 0 to 1"]),
    (["quantize", "m.onnx", "--min-cosine", "1.5"], ["--min-cosine", "from -1 to 1"]),
    (["quantize", "m.onnx", "--latency-rounds", "0"], ["--latency-rounds", "integer >= 1"]),
    (["quantize", "m.onnx", "--eval-count", "0"], ["--eval-count", "integer >= 1"]),
    (["quantize", "m.onnx", "--mode", "static", "--calibration-count", "0"], ["--calibration-count", "integer >= 1"]),
    (["quantize", "m.onnx", "--min-tokens", "0"], ["--min-tokens", "integer >= 1"]),
    (["quantize", "m.onnx", "--max-tokens", "-3"], ["--max-tokens", "integer >= 1"]),
    (["quantize", "m.onnx", "--seed", "-1"], ["--seed", "integer >= 0"]),
    (["quantize", "m.onnx", "--threads", "-1"], ["--threads", "integer >= 0"]),
    (["quantize", "m.onnx", "--op-types", "Bogus"], ["--op-types", "item 1 'Bogus' is not an op type", "MatMul"]),
    (["quantize", "m.onnx", "--op-types", "MatMul,,Gather"], ["--op-types", "item 2 is empty"]),
    # fleet build-model: --hidden 0 divided by zero, -8 reached numpy ("negative dimensions…", no flag named)
    (["build-model", "--kind", "lm", "--hidden", "0"], ["--hidden", "must be an integer >= 1", "'0'"]),
    (["build-model", "--kind", "lm", "--hidden", "-8"], ["--hidden", "must be an integer >= 1"]),
    (["build-model", "--kind", "lm", "--layers", "0"], ["--layers", "must be an integer >= 1"]),
    (["build-model", "--kind", "lm", "--heads", "0"], ["--heads", "must be an integer >= 1"]),
    (["build-model", "--kind", "llama", "--kv-heads", "0"], ["--kv-heads", "must be an integer >= 1"]),
    (["build-model", "--kind", "identity", "--vocab", "-1"], ["--vocab", "must be an integer >= 1"]),
    (["build-model", "--kind", "identity", "--max-positions", "0"], ["--max-positions", "must be an integer >= 1"]),
    (["build-model", "--kind", "lm", "--seed", "-1"], ["--seed", "must be an integer >= 0"]),
])  # fmt: skip
def test_a_flag_out_of_range_is_refused_naming_the_flag_and_the_range(
    argv: list[str], says: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    line = err.strip().splitlines()[-1]
    assert all(word in line for word in says), line
    assert "invalid _" not in line  # no internal function name


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("fleet: "), lines
    return lines[0]


def test_stop_token_ids_that_are_not_integers_are_bad_input(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FLEET_REDIS_URL", DOWN)
    code = fleet_main(["submit", "--model", "demo-lm", "--tokens", "1,2", "--stop-token-ids", "a,b"])
    assert code == 2 and "--stop-token-ids must be comma-separated integers" in _one_line(capsys)


@pytest.mark.parametrize(("flags", "says"), [
    (["--heads", "7"], ["--heads=7", "--hidden=64 is not a multiple"]),
    (["--vocab", "10"], ["--vocab=10 is too small", "259"]),
])  # fmt: skip
def test_build_model_names_the_flag_and_the_rule(
    flags: list[str], says: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = fleet_main(["build-model", "--kind", "lm", "--out-dir", str(tmp_path), *flags])
    line = _one_line(capsys)
    assert code == 2 and all(word in line for word in says), line
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_a_redis_url_with_a_bad_port_is_a_settings_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for url in ("redis://127.0.0.1:notaport/0", "redis://127.0.0.1:99999/0", "redis://fleet:sekret/0"):
        monkeypatch.setenv("FLEET_REDIS_URL", url)
        code = fleet_main(["status"])
        line = _one_line(capsys)
        assert code == 2 and "redis_url (FLEET_REDIS_URL)" in line and "0 to 65535" in line, line
        assert "sekret" not in line


def test_quantize_refuses_a_shortest_prompt_longer_than_the_longest(capsys: pytest.CaptureFixture[str]) -> None:
    code = fleet_main(["quantize", "m.onnx", "--min-tokens", "9", "--max-tokens", "8"])
    assert code == 2
    assert capsys.readouterr().err.strip() == "fleet quantize: --min-tokens (9) must be <= --max-tokens (8)"


@pytest.mark.parametrize(("url", "database"), [
    ("redis://127.0.0.1:1/abc", "'abc'"),  # redis-py ran on database 0, Celery raised ValueError
    ("redis://127.0.0.1:1/1_0", "'1_0'"),  # int() reads 10
    ("redis://127.0.0.1:1/-1", "'-1'"),
    ("redis://127.0.0.1:1/0/", "'0/'"),  # redis-py read 0, Celery refused it
    ("rediss://127.0.0.1:1/x?ssl_cert_reqs=none", "'x'"),
    ("unix:///tmp/redis.sock?db=abc", "'abc'"),
    ("redis://127.0.0.1:1/0?db=two", "'two'"),
    ("sentinel://127.0.0.1:1/0;sentinel://127.0.0.1:2/zz", "'zz'"),  # every part, as the port
    ("redis://fleet:12/sekret@127.0.0.1:1/0", ""),  # a password with a / in it: the "database" is not shown
])  # fmt: skip
def test_a_redis_url_whose_database_is_not_an_integer_is_a_settings_error(
    url: str, database: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FLEET_REDIS_URL", url)
    for argv in (["status"], ["submit", "--model", "demo-lm", "--tokens", "5"], ["probe", "ready"]):
        code = fleet_main(argv)
        line = _one_line(capsys)
        assert code == 2 and line.startswith("fleet: invalid setting redis_url (FLEET_REDIS_URL): database"), line
        assert f"database{' ' + database if database else ''} is not an integer from 0 to" in line, line
        assert "sekret" not in line


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/15", "redis://127.0.0.1:6379",
                                 "redis://127.0.0.1:6379/", "unix:///tmp/redis.sock?db=3", "rediss://h:1/2?ssl_cert_reqs=none"])
def test_a_redis_url_with_an_integer_database_or_none_is_accepted(url: str) -> None:
    assert FleetSettings(redis_url=url).redis_url == url


@pytest.mark.parametrize(("argv", "passed"), [
    (["--logfile", "w.log"], ["--logfile", "w.log"]),  # was: unrecognized arguments
    (["-c", "8", "-O", "fair", "--max-tasks-per-child", "5"], ["-O", "fair", "--max-tasks-per-child", "5"]),
    (["--logfile", "w.log", "--", "-O", "fair"], ["--logfile", "w.log", "-O", "fair"]),  # Celery got the -- itself
    (["--", "--loglevel", "debug"], ["--loglevel", "debug"]),  # after --: Celery's, not fleet worker's
    ([], []),
])  # fmt: skip
def test_fleet_worker_passes_the_options_it_does_not_read_to_celery_in_order(
    argv: list[str], passed: list[str]
) -> None:
    args = build_parser().parse_args(["worker", "--model", "demo-lm", *argv])
    assert celery_args(args.celery_args) == passed and args.model == "demo-lm"


@pytest.mark.parametrize(("argv", "option", "use"), [
    (["-P", "prefork"], "-P", "--concurrency N (worker.concurrency)"),
    (["--pool=solo"], "--pool", "--concurrency N (worker.concurrency)"),
    (["-Psolo"], "-P", "threads pool"),
    (["-Q", "x"], "-Q", "models.<name>.queue"),
    (["--exclude-queues", "x"], "--exclude-queues", "models.<name>.queue"),
    (["--autoscale", "10,3"], "--autoscale", "--concurrency N"),
    (["--", "-c", "8"], "-c", "before any --"),
])  # fmt: skip
def test_fleet_worker_refuses_the_celery_options_the_fleet_sets_naming_the_setting(
    argv: list[str], option: str, use: str
) -> None:
    args = build_parser().parse_args(["worker", "--model", "demo-lm", *argv])
    with pytest.raises(ConfigError) as refused:
        celery_args(args.celery_args)
    assert str(refused.value).startswith(f"fleet worker does not pass {option} to celery: ") and use in str(
        refused.value), refused.value


def test_only_fleet_worker_passes_unknown_options(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, unknown in ((["status", "--logfile", "x"], "--logfile x"),
                          (["--logfile", "worker"], "--logfile")):  # before the sub-command: fleet's own
        with pytest.raises(SystemExit) as exited:
            build_parser().parse_args(argv)
        assert exited.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == f"fleet: error: unrecognized arguments: {unknown}"


def test_a_readiness_probe_with_no_model_configured_fails_before_asking_redis(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """(it said ``ok`` where Redis answered: tests/integration/test_first_day_cli_faces.py)"""
    monkeypatch.chdir(tmp_path)  # no configs/fleet.yaml here
    monkeypatch.delenv("FLEET_CONFIG", raising=False)
    monkeypatch.setenv("FLEET_REDIS_URL", DOWN)
    assert fleet_main(["probe", "ready"]) == 1
    assert capsys.readouterr().err.strip() == (
        f"fleet probe ready: FAIL: no models configured (no config file was read: configs/fleet.yaml is not in "
        f"{tmp_path}; run from the folder that holds it, or set FLEET_CONFIG to its path)")
    empty = tmp_path / "no-models.yaml"
    empty.write_text("models: {}\n")
    assert fleet_main(["probe", "ready", "--config", str(empty)]) == 1
    said = capsys.readouterr().err.strip()
    assert said == f"fleet probe ready: FAIL: no models configured: {empty} has none under models", said


@pytest.fixture
def lm(tmp_path: Path) -> Path:
    """A demo-sized LM with its card (built in a fraction of a second)."""
    return build_causal_lm(tmp_path / "models", name="tiny-lm", hidden_size=16, num_heads=2, num_layers=1)


def test_a_corrupt_onnx_file_is_a_model_load_error_naming_it(lm: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lm.write_bytes(b"garbage\n")  # the card beside it is valid
    with pytest.raises(ModelLoadError) as err:  # what a worker loads first (lm_head_last is on by default)
        serving_graph(lm, EngineSettings(), load_card(lm))
    assert str(err.value).startswith(f"{lm} is not a readable ONNX model: ") and err.value.field == "path"
    code = fleet_main(["quantize", str(lm)])
    assert code == 2 and f"{lm} is not a readable ONNX model" in capsys.readouterr().err


@pytest.mark.parametrize(("card_text", "says"), [
    ("{bad json", "Invalid JSON"),
    (None, "vocab_size: Input should be greater than 0"),
])  # fmt: skip
def test_an_invalid_card_is_one_line_naming_the_file_and_the_first_problem(
    card_text: str | None, says: str, lm: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    card = lm.with_suffix(".json")
    zero_vocab = json.dumps({**json.loads(card.read_text()), "vocab_size": 0})
    card.write_text(card_text if card_text is not None else zero_vocab)
    config = tmp_path / "fleet.yaml"
    config.write_text(json.dumps({"redis_url": DOWN, "models": {"tiny-lm": {"path": str(lm)}}}))
    monkeypatch.delenv("FLEET_REDIS_URL", raising=False)
    code = fleet_main(["submit", "--config", str(config), "--model", "tiny-lm", "--text", "hi"])
    line = _one_line(capsys)
    assert code == 2 and f"model card {card} is invalid: " in line and says in line, line


@pytest.mark.parametrize(("flags", "field"), [
    (["--deadline-s", "-5"], "deadline_s"),  # queued, then expired: refused as POST /v1/requests refuses it
    (["--deadline-s", "0"], "deadline_s"),
    (["--request-id", ""], "request_id"),  # replaced by a fresh ID without a word
    (["--request-id", "user 7/turn 2"], "request_id"),  # queued, then out of the gateway's reach (its URL)
])  # fmt: skip
def test_a_submit_the_gateway_would_refuse_is_refused_before_anything_is_queued(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], flags: list[str], field: str
) -> None:
    monkeypatch.setenv("FLEET_REDIS_URL", DOWN)
    code = fleet_main(["submit", "--model", "demo-lm", "--tokens", "5", *flags])
    assert code == 2
    assert field in _one_line(capsys)


@pytest.mark.parametrize(("flag", "env", "level"), [([], "ERROR", "ERROR"), (["-l", "debug"], "ERROR", "DEBUG"),
                                                    ([], None, "INFO")])  # fmt: skip
def test_fleet_worker_runs_celery_at_the_configured_log_level(
    monkeypatch: pytest.MonkeyPatch, flag: list[str], env: str | None, level: str
) -> None:
    """``fleet worker`` passed ``--loglevel INFO`` to Celery whatever ``worker.loglevel`` said."""
    import producer.cli as cli

    ran: list[list[str]] = []

    def execvp(file: str, argv: list[str]) -> None:
        ran.append(argv)
        raise SystemExit(0)

    monkeypatch.setattr(cli.os, "execvp", execvp)
    monkeypatch.setenv("FLEET_WORKER__MODEL", "demo-lm")  # cmd_worker sets it: restored after the test
    if env is not None:
        monkeypatch.setenv("FLEET_WORKER__LOGLEVEL", env)
    with pytest.raises(SystemExit):
        cli.cmd_worker(build_parser().parse_args(["worker", "--model", "demo-lm", "--hostname", "w@h", *flag]))
    argv = ran[0]
    assert argv[argv.index("--loglevel") + 1] == level


@pytest.mark.parametrize(("argv", "says"), [
    # a model file that is not there is named as such (was: "no model card nonexist.json … next to it")
    (["quantize", "{tmp}/nonexist.onnx"], ["{tmp}/nonexist.onnx: no such model file", "fleet build-model"]),
    # a folder where its .onnx file belongs (was: "no model card tmp.json or config.json next to …")
    (["quantize", "{tmp}"], ["{tmp} is a folder (it holds no .onnx file): point the model's path at the .onnx"]),
    # a folder that cannot be made is said as the system says it, without advice to build what it builds
    (["build-model", "--out-dir", "/proc/nope"], ["/proc/nope: no such file or directory"]),
    (["build-model", "--out-dir", "/dev/null/x"], ["/dev/null/x/demo-lm: not a directory"]),  # was "unexpected …"
])  # fmt: skip
def test_a_path_that_cannot_be_used_is_one_line_naming_it(
    argv: list[str], says: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = fleet_main([arg.format(tmp=tmp_path) for arg in argv])
    line = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in line, line
    assert all(text.format(tmp=tmp_path) in line for text in says) and "unexpected" not in line, line
    assert "build-model" not in line or argv[0] != "build-model", line
