"""The producer-side tokenizers: byte round trips and the errors of ``load_tokenizer``."""

from __future__ import annotations

from pathlib import Path

import pytest

from protocol.errors import ModelLoadError
from protocol.modelcard import ModelCard
from protocol.tokenization import BYTE_OFFSET, ByteTokenizer, HFTokenizer, load_tokenizer
from tools.wordpiece import train_wordpiece


def _card(**overrides: object) -> ModelCard:
    fields: dict[str, object] = {
        "name": "m",
        "version": "1.0.0",
        "kind": "causal_lm",
        "vocab_size": 512,
        "max_positions": 64,
        "num_layers": 1,
        "num_heads": 1,
        "head_dim": 4,
        "hidden_size": 4,
    }
    fields.update(overrides)
    return ModelCard.model_validate(fields)


@pytest.mark.parametrize("text", ["", "hello", "héllo wörld", "日本語 ✓", "emoji 🙂\n\ttab", "\x00\x7f"])
def test_byte_round_trip(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8"))
    assert all(BYTE_OFFSET <= i < ByteTokenizer.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_byte_ids_are_shifted_bytes() -> None:
    assert ByteTokenizer().encode("A\x00") == [ord("A") + BYTE_OFFSET, BYTE_OFFSET]
    assert ByteTokenizer.vocab_size == 259


def test_byte_decode_skips_special_and_out_of_range_ids() -> None:
    tok = ByteTokenizer()
    ids = [tok.bos_token_id, *tok.encode("ok"), tok.eos_token_id, tok.pad_token_id, 259, 100_000]
    assert tok.decode(ids) == "ok"


def test_byte_decode_replaces_broken_utf8() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("é")[:1]  # first byte of a two-byte character
    assert tok.decode(ids) == "\ufffd"


def test_load_byte_tokenizer() -> None:
    assert isinstance(load_tokenizer(_card(), Path(".")), ByteTokenizer)
    assert isinstance(load_tokenizer(_card(vocab_size=259), Path(".")), ByteTokenizer)


def test_load_byte_tokenizer_vocab_too_small() -> None:
    with pytest.raises(ModelLoadError, match="vocab_size >= 259") as info:
        load_tokenizer(_card(vocab_size=258), Path("."))
    assert info.value.field == "vocab_size"
    assert info.value.limit == 259


def test_load_tokenizer_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found") as info:
        load_tokenizer(_card(tokenizer="nope.tokenizer.json"), tmp_path)
    assert info.value.field == "tokenizer"
    assert info.value.limit == str(tmp_path / "nope.tokenizer.json")


def test_load_tokenizer_unreadable_file(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot load tokenizer") as info:
        load_tokenizer(_card(tokenizer="bad.json"), tmp_path)
    assert info.value.field == "tokenizer"


def test_load_wordpiece_tokenizer(tmp_path: Path) -> None:
    train_wordpiece(tmp_path / "wp.json", 512)
    tok = load_tokenizer(_card(kind="encoder", tokenizer="wp.json"), tmp_path)
    assert isinstance(tok, HFTokenizer)
    ids = tok.encode("The queue grows, and nothing is lost.")
    assert ids[0] == 2 and ids[-1] == 3  # [CLS] … [SEP]
    assert all(0 <= i < 512 for i in ids)
    assert tok.decode(ids) == "the queue grows, and nothing is lost."
