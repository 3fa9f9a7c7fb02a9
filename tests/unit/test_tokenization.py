"""The producer-side tokenizers: byte round trips, the errors of ``load_tokenizer``, a tokenizer.json's
own padding/truncation switched off, and text that is not valid Unicode refused."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from tokenizers import Tokenizer as LibTokenizer

from protocol.errors import InputTooLong, InvalidRequest, ModelLoadError, error_from_payload
from protocol.modelcard import ModelCard
from protocol.settings import LimitSettings
from protocol.tokenization import BYTE_OFFSET, ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer
from protocol.validation import check_input
from tests.unit.tiny_tokenizers import byte_level_bpe, sentencepiece_bpe, wordpiece
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


def test_load_no_tokenizer() -> None:
    assert load_tokenizer(_card(tokenizer="none"), Path(".")) is None
    assert load_tokenizer(_card(tokenizer="none", vocab_size=10), Path(".")) is None  # no byte-vocab check


# -- a tokenizer.json's own padding and truncation are off ---------------------------------------------

SHORT = "The queue grows, don't worry!"
LONG = "the queue grows and the workers work " * 40  # ~280 tokens: over the file's 128 and the limit


@pytest.mark.parametrize("factory", [wordpiece, byte_level_bpe], ids=["wordpiece", "bpe"])
@pytest.mark.parametrize("text", [SHORT, LONG], ids=["short", "long"])
def test_file_padding_and_truncation_are_ignored(
    tmp_path: Path, factory: Callable[..., Path], text: str
) -> None:
    padded = factory(tmp_path / "padded.json", pad_to=128, truncate_at=128)
    plain = factory(tmp_path / "plain.json")
    assert len(LibTokenizer.from_file(str(padded)).encode(text).ids) == 128  # the file does pad/truncate
    expected = LibTokenizer.from_file(str(plain)).encode(text).ids
    assert HFTokenizer(padded).encode(text) == HFTokenizer(plain).encode(text) == expected
    assert len(expected) < 40 if text is SHORT else len(expected) > 128


@pytest.mark.parametrize("factory", [wordpiece, byte_level_bpe], ids=["wordpiece", "bpe"])
def test_over_long_text_follows_the_fleet_limits(tmp_path: Path, factory: Callable[..., Path]) -> None:
    ids = HFTokenizer(factory(tmp_path / "t.json", pad_to=128, truncate_at=128)).encode(LONG)
    assert len(ids) > 128

    def check(truncate: str) -> tuple[list[int], bool]:
        limits = LimitSettings(max_input_tokens=128, truncate=truncate)  # type: ignore[arg-type]
        checked = check_input(ids, limits=limits, vocab_size=1000)
        return checked.input_ids, checked.truncated

    with pytest.raises(InputTooLong, match="max_input_tokens=128") as info:
        check("none")
    assert (info.value.field, info.value.limit) == ("input_ids", 128)
    assert check("left") == (ids[-128:], True)
    assert check("right") == (ids[:128], True)


def test_builder_wordpiece_file_has_no_padding_or_truncation(tmp_path: Path) -> None:
    train_wordpiece(tmp_path / "wp.json", 512)
    doc = json.loads((tmp_path / "wp.json").read_text())
    assert doc["padding"] is None and doc["truncation"] is None


# -- text that cannot be UTF-8 encoded -------------------------------------------------------------------


def _tokenizers(tmp_path: Path) -> list[Tokenizer]:
    return [
        ByteTokenizer(),
        HFTokenizer(wordpiece(tmp_path / "wp.json")),
        HFTokenizer(byte_level_bpe(tmp_path / "bpe.json")),
        HFTokenizer(sentencepiece_bpe(tmp_path / "sp.json")),
    ]


@pytest.mark.parametrize(
    ("text", "says"),
    [("\ud800abc", "U+D800 at character 0"), ("abc\udfff", "U+DFFF at character 3"), ("ok \ud83d", "U+D83D")],
)
def test_lone_surrogates_are_refused_naming_text(tmp_path: Path, text: str, says: str) -> None:
    for tok in _tokenizers(tmp_path):
        with pytest.raises(InvalidRequest, match="lone surrogate") as info:
            tok.encode(text)
        assert type(info.value) is InvalidRequest and info.value.field == "text"
        assert says in str(info.value)
        rebuilt = error_from_payload("InvalidRequest", json.loads(json.dumps(info.value.args)))
        assert (type(rebuilt), rebuilt.field, str(rebuilt)) == (InvalidRequest, "text", str(info.value))


def test_surrogate_pairs_are_fine(tmp_path: Path) -> None:
    paired = "\ud83d\ude42".encode("utf-16", "surrogatepass").decode("utf-16")  # a pair, joined: 🙂
    assert paired == "🙂"
    for tok in _tokenizers(tmp_path):
        assert tok.encode(paired) == tok.encode("🙂") and tok.encode(paired)
