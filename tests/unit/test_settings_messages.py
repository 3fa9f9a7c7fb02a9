"""Settings sources and rules, the message schema, and request validation (no I/O beyond tmp files)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from protocol.errors import (
    ConfigError,
    DecodeError,
    EmptyInput,
    InputTooLong,
    InvalidRequest,
    TokenOutOfRange,
    UnknownModel,
    error_from_payload,
)
from protocol.messages import GenerationParams, OutputSpec, Usage, decode_request
from protocol.settings import LimitSettings, load_settings
from protocol.streams import StreamEvent, decode_event, decode_events, encode_event, encode_events, encode_token
from protocol.validation import check_input, resolve_output


def write(tmp_path: Path, doc: dict[str, object]) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


MODEL = {"demo-lm": {"path": "m/demo-lm-1.0.0.onnx", "batching": {"max_batch_size": 8}}}


def test_yaml_then_env_then_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = write(tmp_path, {"redis_url": "redis://yaml:6379/0", "models": MODEL})
    monkeypatch.setenv("FLEET_RESULT_TTL_S", "77")
    monkeypatch.setenv("FLEET_MODELS__DEMO_LM__BATCHING__MAX_WAIT_MS", "9")
    s = load_settings(cfg)
    assert s.redis_url == "redis://yaml:6379/0"
    assert s.result_ttl_s == 77
    assert list(s.models) == ["demo-lm"]  # the env variable merged into the YAML model, not a second one
    assert s.model("demo_lm").batching.max_wait_ms == 9
    assert s.model("demo-lm").batching.max_batch_size == 8
    assert s.model("demo-lm").path == (tmp_path / "m/demo-lm-1.0.0.onnx").resolve()
    assert s.queue_for("DEMO-LM") == "fleet.demo-lm"
    monkeypatch.setenv("FLEET_REDIS_URL", "redis://env:6379/1")
    assert load_settings(cfg).redis_url == "redis://env:6379/1"


def test_overrides_beat_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """load_settings' (and FleetClient.from_settings') overrides beat FLEET_* variables, as documented; the
    environment still beats the YAML file for what they leave alone. Before, the merged settings were validated
    again with the environment as their first source: FLEET_REDIS_URL silently replaced the redis_url asked for."""
    cfg = write(tmp_path, {"redis_url": "redis://yaml:6379/0", "models": MODEL})
    monkeypatch.setenv("FLEET_REDIS_URL", "redis://env:6379/0")
    monkeypatch.setenv("FLEET_RESULT_TTL_S", "5")
    monkeypatch.setenv("FLEET_VISIBILITY_TIMEOUT_S", "99")
    monkeypatch.setenv("FLEET_MODELS__DEMO_LM__BATCHING__MAX_WAIT_MS", "9")
    s = load_settings(cfg, redis_url="redis://asked:6555/3", result_ttl_s=7200,
                      models={"demo-lm": {"batching": {"max_batch_size": 4}}})  # fmt: skip
    assert (s.redis_url, s.result_ttl_s, s.visibility_timeout_s) == ("redis://asked:6555/3", 7200, 99)
    assert (s.model("demo-lm").batching.max_batch_size, s.model("demo-lm").batching.max_wait_ms) == (4, 9)
    monkeypatch.setenv("FLEET_MODELS__DEMO_LM__BATCHING__MAX_BATCH_SIZE", "2")
    assert load_settings(cfg, models={"demo-lm": {"batching": {"max_batch_size": 6}}}).model(
        "demo-lm").batching.max_batch_size == 6
    assert load_settings(cfg).model("demo-lm").batching.max_batch_size == 2  # no override: the environment's


@pytest.mark.parametrize("override", [{"result_ttl_s": 0}, {"redis_url": "http://x"}, {"worker": {"bogus": 1}}])
def test_an_invalid_override_is_refused_even_where_the_environment_is_valid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, override: dict[str, object]
) -> None:
    monkeypatch.setenv("FLEET_RESULT_TTL_S", "5")
    monkeypatch.setenv("FLEET_REDIS_URL", "redis://env:6379/0")
    with pytest.raises(ConfigError, match=r"^override refused: (invalid|unknown) setting " + next(iter(override))):
        load_settings(write(tmp_path, {"models": MODEL}), **override)


@pytest.mark.parametrize(
    ("doc", "env", "says"),
    [
        ({"result_ttl_s": 0}, {}, "invalid setting result_ttl_s (FLEET_RESULT_TTL_S): Input should be greater"),
        ({"redis_url": "http://x"}, {}, "redis_url"),
        ({"models": MODEL}, {"FLEET_MODELS__DEMO_LM__BATCHING__MAX_BATCH_SIZE": "0"}, "max_batch_size"),
        ({"models": MODEL, "worker": {"concurrency": 4}}, {}, "worker.concurrency (4) must be >= models.demo-lm"),
        ({"models": MODEL}, {"FLEET_WORKER__LOGLEVEL": "LOUD"}, "worker.loglevel"),
        ({"surprise": 1}, {}, "surprise"),
    ],
)
def test_invalid_settings_name_the_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, doc: dict[str, object], env: dict[str, str], says: str
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, doc))
    assert says in str(info.value)


def test_missing_explicit_config_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "nope.yaml")


def test_unknown_model_lists_the_configured_ones(tmp_path: Path) -> None:
    s = load_settings(write(tmp_path, {"models": MODEL}))
    with pytest.raises(UnknownModel, match="configured models: demo-lm"):
        s.model("gpt")


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ([1, 2], "request"),
        ({"input_ids": [1]}, "model"),
        ({"model": "m", "input_ids": "123"}, "input_ids"),
        ({"model": "m", "input_ids": [1, 2.0]}, "input_ids.1"),
        ({"model": "m", "input_ids": [1], "schema_version": 2}, "schema_version"),
        ({"model": "m", "input_ids": [1], "output": {"top_k": "5"}}, "output.top_k"),
    ],
)
def test_decode_request_names_the_field(payload: object, field: str) -> None:
    with pytest.raises(DecodeError) as info:
        decode_request(payload)
    assert info.value.field == field


LIMITS = LimitSettings(max_input_tokens=4, max_top_k=8)


def test_check_input_limits_and_truncation() -> None:
    assert check_input([1, 2, 3], limits=LIMITS, vocab_size=10).input_ids == [1, 2, 3]
    with pytest.raises(EmptyInput):
        check_input([], limits=LIMITS, vocab_size=10)
    with pytest.raises(InputTooLong, match="max_input_tokens=4"):
        check_input([1] * 5, limits=LIMITS, vocab_size=10)
    with pytest.raises(TokenOutOfRange, match=r"input_ids\[1\] = 10 is outside the vocabulary \[0, 10\)"):
        check_input([1, 10], limits=LIMITS, vocab_size=10)
    left = check_input([1, 2, 3, 4, 5, 6], limits=LimitSettings(max_input_tokens=4, truncate="left"), vocab_size=10)
    assert (left.input_ids, left.truncated) == ([3, 4, 5, 6], True)
    right = check_input([1, 2, 3, 4, 5], limits=LimitSettings(max_input_tokens=4, truncate="right"), vocab_size=10)
    assert right.input_ids == [1, 2, 3, 4]


def test_check_input_holds_to_the_models_positions_where_they_are_fewer_than_the_limit() -> None:
    wide = LimitSettings(max_input_tokens=8)
    assert check_input([1] * 4, limits=wide, vocab_size=10, max_positions=4).input_ids == [1] * 4
    says = r"the limit is 4, the model's max_positions \(limits.max_input_tokens=8"
    with pytest.raises(InputTooLong, match=says) as info:
        check_input([1] * 5, limits=wide, vocab_size=10, max_positions=4)
    assert (info.value.field, info.value.limit) == ("input_ids", 4)
    with pytest.raises(InputTooLong, match=r"max_input_tokens=4$"):  # the setting is the smaller: it is named
        check_input([1] * 5, limits=LIMITS, vocab_size=10, max_positions=512)
    cut = check_input([1, 2, 3, 4, 5, 6], limits=LimitSettings(max_input_tokens=8, truncate="left"), vocab_size=10,
                      max_positions=4)  # fmt: skip
    assert (cut.input_ids, cut.truncated) == ([3, 4, 5, 6], True)


def test_resolve_output() -> None:
    assert resolve_output(OutputSpec(), model_kind="causal_lm", limits=LIMITS).kind == "next_token"
    assert resolve_output(OutputSpec(), model_kind="encoder", limits=LIMITS).kind == "embedding"
    with pytest.raises(InvalidRequest, match="max_top_k=8"):
        resolve_output(OutputSpec(top_k=9), model_kind="causal_lm", limits=LIMITS)
    with pytest.raises(InvalidRequest, match="encoder model produces 'embedding'"):
        resolve_output(OutputSpec(kind="next_token"), model_kind="encoder", limits=LIMITS)
    with pytest.raises(InvalidRequest, match="encoder model produces 'embedding'"):
        resolve_output(OutputSpec(kind="generate"), model_kind="encoder", limits=LIMITS)


def test_resolve_generation() -> None:
    spec = resolve_output(OutputSpec(kind="generate"), model_kind="causal_lm", limits=LIMITS)
    assert spec.generation == GenerationParams()  # defaults filled in
    params = GenerationParams(max_new_tokens=LIMITS.max_new_tokens)
    assert resolve_output(OutputSpec(generation=params), model_kind="causal_lm", limits=LIMITS).kind == "generate"
    with pytest.raises(InvalidRequest, match=f"max_new_tokens={LIMITS.max_new_tokens}") as info:
        resolve_output(
            OutputSpec(generation=GenerationParams(max_new_tokens=LIMITS.max_new_tokens + 1)),
            model_kind="causal_lm",
            limits=LIMITS,
        )
    assert info.value.field == "output.generation.max_new_tokens"
    with pytest.raises(InvalidRequest, match=r"only for output.kind 'generate'"):
        resolve_output(OutputSpec(kind="next_token", generation=params), model_kind="causal_lm", limits=LIMITS)


def test_stream_events_round_trip() -> None:
    event = StreamEvent(
        type="final", index=3, finish_reason="length", usage=Usage(prompt_tokens=2, completion_tokens=3, total_tokens=5)
    )
    assert decode_event(encode_event(event)) == event
    assert decode_event({b"e": encode_event(event)["e"].encode()}).is_last
    with pytest.raises(DecodeError):
        decode_event({"x": "1"})


def test_a_coalesced_entry_holds_its_events_in_order_and_an_e_only_reader_sees_the_first() -> None:
    events = [StreamEvent(type="token", index=i, token_id=10 + i, text=f"<{i}>") for i in range(3)]
    events.append(StreamEvent(type="final", index=3, finish_reason="length"))
    fields = encode_events([encode_event(e)["e"] for e in events])
    assert list(fields) == ["e", "r"]
    assert decode_events(fields) == events
    assert decode_events({k.encode(): v.encode() for k, v in fields.items()}) == events  # as redis-py returns them
    assert decode_event(fields) == events[0]  # a reader of "e" alone: the first event, then an index gap
    assert decode_events(encode_event(events[0])) == [events[0]]
    with pytest.raises(DecodeError, match="'r' field is not a list of events"):
        decode_events({"e": fields["e"], "r": '{"type": "token"}'})


@given(index=st.integers(0, 2**31), token_id=st.integers(0, 2**31),
       text=st.text(st.characters(exclude_categories=["Cs"]), max_size=12))  # a str of decoded UTF-8: no surrogates
def test_a_token_encoded_without_the_model_is_the_model_s_own_json(index: int, token_id: int, text: str) -> None:
    """The worker's per-token fast path writes exactly what encode_event writes for the same event (control
    characters, quotes, backslashes, non-ASCII), so every reader decodes it the same way."""
    event = StreamEvent(type="token", index=index, token_id=token_id, text=text)
    assert encode_token(index, token_id, text) == encode_event(event)["e"]
    assert decode_event({"e": encode_token(index, token_id, text)}) == event
    assert "\n" not in encode_token(index, token_id, text) and "\x1e" not in encode_token(index, token_id, text)


def test_errors_survive_celery_style_rebuilding() -> None:
    err = TokenOutOfRange("input_ids[3] = 9 is outside", "input_ids[3]", 9)
    rebuilt = type(err)(*err.args)  # what Celery does with a stored exception
    assert (str(rebuilt), rebuilt.field, rebuilt.limit) == (str(err), "input_ids[3]", 9)
    again = error_from_payload("TokenOutOfRange", list(err.args))
    assert isinstance(again, TokenOutOfRange) and again.field == "input_ids[3]"
    assert err.to_payload()["error"] == "token_out_of_range"
    assert type(error_from_payload("Nope", ["x"])).__name__ == "FleetError"


def test_a_model_named_only_in_the_environment_keeps_its_hyphen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = write(tmp_path, {"models": MODEL})
    monkeypatch.setenv("FLEET_MODELS__BENCH_LM__PATH", str(tmp_path / "bench-lm.onnx"))
    monkeypatch.setenv("FLEET_MODELS__BENCH_LM__BATCHING__MAX_BATCH_SIZE", "4")
    s = load_settings(cfg)
    assert sorted(s.models) == ["bench-lm", "demo-lm"]
    assert s.queue_for("bench_lm") == "fleet.bench-lm"
    assert s.model("bench-lm").batching.max_batch_size == 4
    assert load_settings(write(tmp_path, {"models": {"bench_lm": MODEL["demo-lm"]}})).queue_for("bench-lm") == (
        "fleet.bench_lm"  # a YAML spelling wins
    )



def test_a_rule_across_settings_is_reported_by_its_names_not_as_settings_fleet(tmp_path: Path) -> None:
    cfg = write(tmp_path, {"models": MODEL, "worker": {"model": "demo-lm", "concurrency": 2}})
    with pytest.raises(ConfigError) as info:
        load_settings(cfg)
    text = str(info.value)
    assert "invalid setting settings" not in text and "(FLEET_)" not in text
    assert text.startswith("invalid settings: worker.concurrency (2) must be >= models.demo-lm.batching.max_batch_size")


@pytest.mark.parametrize(
    ("doc", "says"),
    [
        ({"worker": {"concurency": 4}},
         "unknown setting worker.concurency (FLEET_WORKER__CONCURENCY): did you mean worker.concurrency?"),
        ({"models": {"demo-lm": {**MODEL["demo-lm"], "batching": {"max_batch": 3}}}},
         "unknown setting models.demo-lm.batching.max_batch (FLEET_MODELS__DEMO_LM__BATCHING__MAX_BATCH): did you "
         "mean models.demo-lm.batching.max_batch_size?"),
        ({"worker": {"zzz": 4}}, "unknown setting worker.zzz (FLEET_WORKER__ZZZ): worker has no such setting; its "
         "settings: allow_untested_kombu, concurrency,"),
        ({"redis_url": "localhost:6379"}, "invalid setting redis_url (FLEET_REDIS_URL): must start with redis://, "
         "rediss://, unix:// or sentinel:// (e.g. redis://127.0.0.1:6379/0)"),
        ({"store": {"endpoint_url": "s3.local"}}, "invalid setting store.endpoint_url (FLEET_STORE__ENDPOINT_URL): "
         "must start with http:// or https://"),
    ],
)
def test_a_misspelt_setting_is_named_with_the_closest_one_and_a_url_with_its_schemes(
    tmp_path: Path, doc: dict[str, object], says: str
) -> None:
    """Before: ``Extra inputs are not permitted`` and ``String should match pattern '^(redis|rediss|…)://'``."""
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, {"models": MODEL, **doc}))
    assert says in str(info.value), str(info.value)
