"""The model card of a card-less (optimum export) folder, read from its Hugging Face ``config.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from protocol.errors import ModelLoadError
from protocol.modelcard import ModelCard, load_card
from protocol.tokenization import HFTokenizer, load_tokenizer
from tests.unit.tiny_tokenizers import wordpiece

GPT2 = {
    "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 1000, "n_embd": 64, "n_head": 4,
    "n_layer": 2, "n_positions": 256, "n_ctx": 256, "bos_token_id": 0, "eos_token_id": 17, "pad_token_id": None,
}  # fmt: skip
"""What ``GPT2Config(...).save_pretrained`` writes (the keys the fleet reads)."""

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000, "hidden_size": 64,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "max_position_embeddings": 256,
    "head_dim": 32, "bos_token_id": 1, "eos_token_id": [2, 7], "pad_token_id": None,
}  # fmt: skip
"""Grouped-query attention (2 KV heads for 4 query heads), an explicit head_dim and two EOS ids."""

BERT = {
    "architectures": ["BertModel"], "model_type": "bert", "vocab_size": 30522, "hidden_size": 384,
    "num_attention_heads": 12, "num_hidden_layers": 6, "max_position_embeddings": 512, "pad_token_id": 0,
}  # fmt: skip


def _folder(tmp_path: Path, config: dict[str, Any] | str, *, tokenizer: bool = False) -> Path:
    (tmp_path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if tokenizer:
        wordpiece(tmp_path / "tokenizer.json")
    return tmp_path / "model.onnx"


def _card(tmp_path: Path, config: dict[str, Any], **changes: Any) -> ModelCard:
    return load_card(_folder(tmp_path, {**config, **changes}))


def test_gpt2_config(tmp_path: Path) -> None:
    card = _card(tmp_path, GPT2)
    assert (card.name, card.version, card.kind, card.vocab_size, card.max_positions) == (
        "model", "0.0.0", "causal_lm", 1000, 256)  # fmt: skip
    assert (card.num_layers, card.num_heads, card.num_kv_heads, card.kv_heads, card.head_dim) == (2, 4, None, 4, 16)
    assert (card.hidden_size, card.pad_token_id, card.bos_token_id, card.eos_token_id) == (64, 0, 0, 17)


def test_llama_config_grouped_query_attention(tmp_path: Path) -> None:
    card = _card(tmp_path, LLAMA)
    assert card.kind == "causal_lm"
    assert (card.num_heads, card.num_kv_heads, card.kv_heads, card.head_dim) == (4, 2, 2, 32)
    assert (card.bos_token_id, card.eos_token_id) == (1, 2)  # a list of EOS ids: the card holds the first


@pytest.mark.parametrize(
    ("changes", "kv_heads"),
    [({"num_key_value_heads": None}, None), ({"num_key_value_heads": None, "num_kv_heads": 1}, 1),
     ({"num_key_value_heads": None, "n_head_kv": 2}, 2), ({"num_key_value_heads": None, "multi_query": True}, 1)],
)  # fmt: skip
def test_kv_head_spellings(tmp_path: Path, changes: dict[str, Any], kv_heads: int | None) -> None:
    assert _card(tmp_path, LLAMA, **changes).num_kv_heads == kv_heads


def test_head_dim_defaults_to_hidden_over_heads(tmp_path: Path) -> None:
    assert _card(tmp_path, {k: v for k, v in LLAMA.items() if k != "head_dim"}).head_dim == 16


@pytest.mark.parametrize(("value", "first"), [(None, None), (5, 5), ([9, 3], 9), ([], None)])
def test_eos_id_int_list_or_null(tmp_path: Path, value: object, first: int | None) -> None:
    assert _card(tmp_path, GPT2, eos_token_id=value).eos_token_id == first


def test_bert_config_is_an_encoder(tmp_path: Path) -> None:
    card = _card(tmp_path, BERT)
    assert (card.kind, card.head_dim, card.eos_token_id) == ("encoder", 32, None)


# -- the kind without "architectures" --------------------------------------------------------------

DECODER_TYPES = ["gpt2", "llama", "mistral", "qwen2", "phi", "gpt_neox", "opt", "bloom", "falcon"]
ENCODER_TYPES = ["bert", "roberta", "distilbert", "xlm-roberta", "mpnet", "electra", "deberta"]


@pytest.mark.parametrize("archs", ["absent", None, []])
@pytest.mark.parametrize("model_type", DECODER_TYPES + ENCODER_TYPES)
def test_kind_from_model_type(tmp_path: Path, archs: object, model_type: str) -> None:
    config = {k: v for k, v in BERT.items() if k != "architectures"} | {"model_type": model_type}
    if archs != "absent":
        config["architectures"] = archs
    expected = "causal_lm" if model_type in DECODER_TYPES else "encoder"
    assert load_card(_folder(tmp_path, config)).kind == expected


def test_is_decoder_makes_a_causal_lm(tmp_path: Path) -> None:
    config = {k: v for k, v in BERT.items() if k != "architectures"} | {"is_decoder": True}
    assert load_card(_folder(tmp_path, config)).kind == "causal_lm"


@pytest.mark.parametrize("model_type", [None, "t5", "my-custom-net"])
def test_unknown_kind_is_refused_naming_architectures(tmp_path: Path, model_type: str | None) -> None:
    config = {k: v for k, v in BERT.items() if k != "architectures"} | {"model_type": model_type, "is_decoder": False}
    with pytest.raises(ModelLoadError, match='add "architectures"') as info:
        load_card(_folder(tmp_path, config))
    assert info.value.field == "architectures"


def test_architectures_win_over_model_type(tmp_path: Path) -> None:
    assert _card(tmp_path, BERT, architectures=["BertLMHeadModel"]).kind == "causal_lm"
    assert _card(tmp_path, GPT2, architectures=["GPT2Model"]).kind == "encoder"  # a feature-extraction export


# -- tokenizer and version -------------------------------------------------------------------------


def test_no_tokenizer_json_means_no_tokenizer(tmp_path: Path) -> None:
    card = _card(tmp_path, GPT2)
    assert card.tokenizer == "none"
    assert load_tokenizer(card, tmp_path) is None  # text is refused; ids still work


def test_tokenizer_json_is_used(tmp_path: Path) -> None:
    card = load_card(_folder(tmp_path, BERT, tokenizer=True))
    assert card.tokenizer == "tokenizer.json"
    assert isinstance(load_tokenizer(card, tmp_path), HFTokenizer)


@pytest.mark.parametrize(
    ("changes", "version"),
    [({}, "0.0.0"), ({"version": "2.1.0"}, "2.1.0"), ({"_fleet_version": "3.0.0", "version": "2.1.0"}, "3.0.0"),
     ({"_fleet_version": None, "version": "2.1.0"}, "2.1.0")],
)  # fmt: skip
def test_version_hint(tmp_path: Path, changes: dict[str, Any], version: str) -> None:
    assert _card(tmp_path, GPT2, **changes).version == version


def test_a_card_wins_over_config_json(tmp_path: Path) -> None:
    model = _folder(tmp_path, GPT2)
    card = ModelCard(name="m", version="1.2.3", kind="causal_lm", vocab_size=300, max_positions=64, num_layers=1,
                     num_heads=1, head_dim=4, hidden_size=4, tokenizer="byte")  # fmt: skip
    model.with_suffix(".json").write_text(card.model_dump_json())
    assert load_card(model) == card


# -- bad configs -----------------------------------------------------------------------------------


def test_missing_vocab_size(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no vocab_size") as info:
        _card(tmp_path, {k: v for k, v in GPT2.items() if k != "vocab_size"})
    assert info.value.field == "vocab_size"


@pytest.mark.parametrize(("key", "value"), [("n_head", "4"), ("eos_token_id", 1.5), ("num_key_value_heads", True)])
def test_non_integer_value_names_its_key(tmp_path: Path, key: str, value: object) -> None:
    base = LLAMA if key == "num_key_value_heads" else GPT2
    with pytest.raises(ModelLoadError, match="is not an integer") as info:
        _card(tmp_path, base, **{key: value})
    assert info.value.field == key


def test_out_of_range_value_names_the_card_field(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not describe a usable model") as info:
        _card(tmp_path, GPT2, vocab_size=0)
    assert info.value.field == "vocab_size"


@pytest.mark.parametrize("text", ["{not json", "[1, 2]"])
def test_unreadable_config_json(tmp_path: Path, text: str) -> None:
    with pytest.raises(ModelLoadError, match=r"config\.json") as info:
        load_card(_folder(tmp_path, text))
    assert info.value.field == "card"
