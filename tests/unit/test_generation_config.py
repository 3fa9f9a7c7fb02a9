"""protocol.generation_config: generation defaults and chat templates read from a model's folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from producer.generation_defaults import generation_fields
from protocol.errors import ModelLoadError
from protocol.generation_config import (
    GenerationDefaults,
    load_chat_template,
    load_generation_defaults,
    resolve_generation,
)
from protocol.messages import GenerationParams
from protocol.modelcard import ModelCard
from protocol.settings import BatchingSettings, LimitSettings, ModelSettings


def _card(eos: int | None = 2) -> ModelCard:
    return ModelCard(name="m", version="1.0.0", kind="causal_lm", vocab_size=512, max_positions=64,
                     num_layers=1, num_heads=1, head_dim=8, hidden_size=8, eos_token_id=eos)


def _model(tmp_path: Path, **files: Any) -> Path:
    """A model file path in ``tmp_path`` with ``files`` (name → JSON document or raw text) beside it."""
    for name, doc in files.items():
        (tmp_path / name.replace("__", ".")).write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return tmp_path / "m-1.0.0.onnx"


# -- generation_config.json ------------------------------------------------------------------------


def test_no_file_gives_the_cards_eos_and_no_defaults(tmp_path: Path) -> None:
    assert load_generation_defaults(_model(tmp_path), _card()) == GenerationDefaults(eos_token_ids=frozenset({2}))
    assert load_generation_defaults(_model(tmp_path), _card(None)) == GenerationDefaults()


@pytest.mark.parametrize(("file_eos", "card_eos", "want"), [
    (2, 2, {2}),
    ([2, 7], 2, {2, 7}),
    (7, 2, {2, 7}),
    ([], None, set()),
    (None, 3, {3}),
    ([5, 5], None, {5}),
])  # fmt: skip
def test_eos_ids_are_the_union_of_file_and_card(tmp_path: Path, file_eos: Any, card_eos: int | None,
                                                want: set[int]) -> None:
    path = _model(tmp_path, generation_config__json={"eos_token_id": file_eos})
    assert load_generation_defaults(path, _card(card_eos)).eos_token_ids == frozenset(want)


def test_the_folder_itself_may_be_given(tmp_path: Path) -> None:
    _model(tmp_path, generation_config__json={"eos_token_id": [9], "max_new_tokens": 12})
    got = load_generation_defaults(tmp_path, _card())
    assert (got.eos_token_ids, got.max_new_tokens) == (frozenset({2, 9}), 12)


# do_sample as transformers reads it: knobs count only when sampling; without it decoding is greedy.
@pytest.mark.parametrize(("doc", "want"), [
    ({}, (None, None, None)),
    ({"do_sample": False}, (0.0, None, None)),
    ({"temperature": 0.7, "top_p": 0.9}, (0.0, None, None)),
    ({"do_sample": True}, (1.0, 50, 1.0)),
    ({"do_sample": True, "temperature": 0.6, "top_p": 0.9}, (0.6, 50, 0.9)),
    ({"do_sample": True, "temperature": 1, "top_k": 0}, (1.0, 0, 1.0)),
    ({"do_sample": True, "top_k": None}, (1.0, 0, 1.0)),
    ({"do_sample": True, "top_k": 20, "top_p": 1}, (1.0, 20, 1.0)),
])  # fmt: skip
def test_sampling_defaults_follow_do_sample(tmp_path: Path, doc: dict[str, Any],
                                            want: tuple[float | None, int | None, float | None]) -> None:
    got = load_generation_defaults(_model(tmp_path, generation_config__json=doc), _card())
    assert (got.temperature, got.top_k, got.top_p) == want
    assert got.temperature is None or isinstance(got.temperature, float)


def test_max_new_tokens_and_repetition_penalty_are_taken_as_written(tmp_path: Path) -> None:
    doc = {"max_new_tokens": 40, "repetition_penalty": 1.1, "do_sample": False, "temperature": 0.3,
           "transformers_version": "4.44.0", "max_length": 4096, "bos_token_id": 1}
    got = load_generation_defaults(_model(tmp_path, generation_config__json=doc), _card())
    assert got == GenerationDefaults(eos_token_ids=frozenset({2}), max_new_tokens=40, temperature=0.0,
                                     repetition_penalty=1.1)


def test_defaults_are_frozen(tmp_path: Path) -> None:
    got = load_generation_defaults(_model(tmp_path), _card())
    with pytest.raises(AttributeError):
        got.max_new_tokens = 3  # type: ignore[misc]


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '"eos"', ""])
def test_malformed_generation_config_names_the_file(tmp_path: Path, text: str) -> None:
    path = _model(tmp_path, generation_config__json=text)
    with pytest.raises(ModelLoadError, match=r"generation_config\.json") as info:
        load_generation_defaults(path, _card())
    assert (info.value.field, info.value.limit) == ("generation_config.json", str(tmp_path / "generation_config.json"))


@pytest.mark.parametrize(("doc", "key"), [
    ({"eos_token_id": "2"}, "eos_token_id"),
    ({"eos_token_id": [2, "x"]}, "eos_token_id"),
    ({"eos_token_id": -1}, "eos_token_id"),
    ({"eos_token_id": True}, "eos_token_id"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": 1.5}, "max_new_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -3}, "top_k"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"do_sample": "yes"}, "do_sample"),
])  # fmt: skip
def test_wrong_values_name_the_file_and_the_key(tmp_path: Path, doc: dict[str, Any], key: str) -> None:
    path = _model(tmp_path, generation_config__json=doc)
    with pytest.raises(ModelLoadError, match=rf"generation_config\.json is invalid: .*{key}"):
        load_generation_defaults(path, _card())


def test_an_unreadable_file_is_a_model_load_error(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").mkdir()  # a folder where the file should be
    with pytest.raises(ModelLoadError, match="cannot read"):
        load_generation_defaults(tmp_path / "m-1.0.0.onnx", _card())
    (tmp_path / "tokenizer_config.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(ModelLoadError, match=r"tokenizer_config\.json"):
        load_chat_template(tmp_path / "m-1.0.0.onnx")


# -- chat templates --------------------------------------------------------------------------------


def test_no_tokenizer_config_means_no_template(tmp_path: Path) -> None:
    assert load_chat_template(_model(tmp_path)) is None
    assert load_chat_template(_model(tmp_path, tokenizer_config__json={"eos_token": "</s>"})) is None
    assert load_chat_template(_model(tmp_path, tokenizer_config__json={"chat_template": None})) is None


def test_template_as_a_string(tmp_path: Path) -> None:
    path = _model(tmp_path, tokenizer_config__json={"chat_template": "{{ messages[0]['content'] }}"})
    assert load_chat_template(path) == "{{ messages[0]['content'] }}"


def test_named_templates_take_the_default(tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    assert load_chat_template(_model(tmp_path, tokenizer_config__json={"chat_template": named})) == "D"
    no_default = [{"name": "tool_use", "template": "T"}]
    assert load_chat_template(_model(tmp_path, tokenizer_config__json={"chat_template": no_default})) is None


def test_chat_template_jinja_wins_over_tokenizer_config(tmp_path: Path) -> None:
    path = _model(tmp_path, tokenizer_config__json={"chat_template": "old"}, chat_template__jinja="new\n")
    assert load_chat_template(path) == "new\n"


@pytest.mark.parametrize("doc", [{"chat_template": 3}, {"chat_template": [{"name": "default"}]},
                                 {"chat_template": ["x"]}])
def test_wrong_template_types_name_the_file(tmp_path: Path, doc: dict[str, Any]) -> None:
    with pytest.raises(ModelLoadError, match=r"tokenizer_config\.json is invalid: chat_template"):
        load_chat_template(_model(tmp_path, tokenizer_config__json=doc))


def test_malformed_tokenizer_config_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"tokenizer_config\.json is not valid JSON"):
        load_chat_template(_model(tmp_path, tokenizer_config__json="{'chat_template': 'x'}"))


# -- resolving a request's unset fields ------------------------------------------------------------
TUNED = GenerationDefaults(max_new_tokens=300, temperature=0.7, top_k=7, top_p=0.9, repetition_penalty=1.3)


@pytest.mark.parametrize(
    ("given", "fallbacks", "cap", "expected"),
    [
        ({}, None, None, {"max_new_tokens": 300, "temperature": 0.7, "top_k": 7, "top_p": 0.9,
                          "repetition_penalty": 1.3}),
        ({"temperature": 0.0, "max_new_tokens": 9}, None, None, {"max_new_tokens": 9, "temperature": 0.0, "top_k": 7,
                                                               "top_p": 0.9, "repetition_penalty": 1.3}),
        # a defaulted length is cut to the cap; the caller's is not (the limits check it)
        ({}, None, 40, {"max_new_tokens": 40, "temperature": 0.7, "top_k": 7, "top_p": 0.9, "repetition_penalty": 1.3}),
        ({"max_new_tokens": 500}, None, 40, {"max_new_tokens": 500, "temperature": 0.7, "top_k": 7, "top_p": 0.9,
                                             "repetition_penalty": 1.3}),
    ],
)  # fmt: skip
def test_unset_fields_take_the_model_defaults(given: dict[str, Any], fallbacks: dict[str, Any] | None,
                                              cap: int | None, expected: dict[str, Any]) -> None:
    assert resolve_generation(given, TUNED, fallbacks=fallbacks, max_new_tokens_cap=cap) == expected


def test_a_face_fallback_counts_only_where_the_model_sets_nothing() -> None:
    openai = {"temperature": 1.0, "max_new_tokens": 16}
    assert resolve_generation({"stream": True}, GenerationDefaults(), fallbacks=openai) == {
        "stream": True, "temperature": 1.0, "max_new_tokens": 16}  # fmt: skip
    greedy_model = GenerationDefaults(temperature=0.0, max_new_tokens=64)
    assert resolve_generation({}, greedy_model, fallbacks=openai, max_new_tokens_cap=10) == {
        "temperature": 0.0, "max_new_tokens": 10}  # fmt: skip
    assert resolve_generation({}, GenerationDefaults(), max_new_tokens_cap=0) == {}


def test_a_defaulted_length_fits_the_limit_the_positions_and_the_kv_budget(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 200, "do_sample": False}))
    model_file = tmp_path / "m.onnx"
    model_file.write_bytes(b"")  # only its folder is read
    card = ModelCard(name="m", version="1", kind="causal_lm", vocab_size=300, max_positions=64, num_layers=1,
                     num_heads=1, head_dim=4, hidden_size=4)
    model = ModelSettings(path=model_file, limits=LimitSettings(max_new_tokens=100, max_input_tokens=64),
                          batching=BatchingSettings(max_kv_tokens=40))
    for prompt, expected in ((10, 30), (30, 10), (39, 1), (60, 1)):  # the KV budget (40) binds before 64
        fields = generation_fields({"stream": False}, model=model, card=card, prompt_tokens=prompt)
        assert fields == {"stream": False, "max_new_tokens": expected, "temperature": 0.0}, prompt
    wide = model.model_copy(update={"batching": BatchingSettings(max_kv_tokens=10_000)})
    assert generation_fields(None, model=wide, card=card, prompt_tokens=4)["max_new_tokens"] == 60  # positions
    assert generation_fields(None, model=wide, card=None, prompt_tokens=4) == {}  # no card: no file read
    asked = generation_fields(GenerationParams(max_new_tokens=90), model=model, card=card, prompt_tokens=10)
    assert asked["max_new_tokens"] == 90, "the caller's value is kept, for the limits to refuse"
