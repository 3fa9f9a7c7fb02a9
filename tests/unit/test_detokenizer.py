"""IncrementalDetokenizer: deltas that add up to ``tokenizer.decode`` of every id, never half a character,
from a bounded window of recent ids."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.tokenization import BYTE_OFFSET, ByteTokenizer, HFTokenizer, IncrementalDetokenizer, Tokenizer
from tests.unit.tiny_tokenizers import (
    BPE_WORDS,
    WORDPIECE_VOCAB,
    byte_level_bpe,
    byte_to_char,
    sentencepiece_bpe,
    wordpiece,
)

BYTE = ByteTokenizer()
MULTI_BYTE = "é€日本語🙂👍🏽\u200d"


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> dict[str, HFTokenizer]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {
        "bpe": HFTokenizer(byte_level_bpe(root / "bpe.json")),
        "wordpiece": HFTokenizer(wordpiece(root / "wp.json")),
        "sentencepiece": HFTokenizer(sentencepiece_bpe(root / "sp.json")),
    }


def _stream(tok: Tokenizer, ids: list[int]) -> tuple[list[str], str, IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(i) for i in ids]
    return deltas, detok.flush(), detok


def _assert_exact(tok: Tokenizer, ids: list[int]) -> list[str]:
    deltas, rest, detok = _stream(tok, ids)
    assert "".join(deltas) + rest == detok.text == tok.decode(ids)
    return deltas


# -- byte tokenizer ----------------------------------------------------------------------------------

byte_ids = st.lists(st.integers(0, ByteTokenizer.vocab_size - 1), max_size=60)
"""Any ids: specials, ASCII, stray continuation bytes, truncated and over-long sequences."""

# valid Unicode only: a lone surrogate is refused at encode (protocol.tokenization names it), no text to detokenize
texts = st.text(st.sampled_from([*MULTI_BYTE, "a", " ", "\n"]) | st.characters(exclude_categories=["Cs"]), max_size=30)


@settings(max_examples=400, deadline=None)
@given(byte_ids)
def test_byte_any_ids_exact(ids: list[int]) -> None:
    _assert_exact(BYTE, ids)


@settings(max_examples=300, deadline=None)
@given(texts, st.lists(st.sampled_from([0, 1, 2]), max_size=5), st.randoms(use_true_random=False))
def test_byte_text_exact_and_never_splits_a_character(text: str, specials: list[int], rnd: random.Random) -> None:
    ids = BYTE.encode(text)
    for special in specials:  # pads/bos/eos anywhere, even inside a character's bytes
        ids.insert(rnd.randrange(len(ids) + 1), special)
    deltas = _assert_exact(BYTE, ids)
    assert all("\ufffd" not in d for d in deltas) or "\ufffd" in text
    assert "".join(deltas) == text  # valid UTF-8: nothing is left for flush


def test_emoji_is_released_whole_on_its_last_byte() -> None:
    detok = IncrementalDetokenizer(BYTE)
    assert [detok.add(i) for i in BYTE.encode("a🙂b")] == ["a", "", "", "", "🙂", "b"]
    assert detok.flush() == "" and detok.text == "a🙂b"


def test_flush_releases_an_incomplete_character_as_replacement() -> None:
    detok = IncrementalDetokenizer(BYTE)
    ids = BYTE.encode("ok🙂")[:-1]
    assert "".join(detok.add(i) for i in ids) == "ok"
    assert detok.flush() == "\ufffd" and detok.text == BYTE.decode(ids) == "ok\ufffd"
    assert detok.flush() == ""


def test_genuine_replacement_character_is_held_then_released() -> None:
    detok = IncrementalDetokenizer(BYTE)
    assert [detok.add(i) for i in BYTE.encode("\ufffdx")] == ["", "", "", "\ufffdx"]


# -- Hugging Face tokenizers -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["bpe", "wordpiece", "sentencepiece"])
@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_hf_any_ids_exact(hf: dict[str, HFTokenizer], name: str, data: st.DataObject) -> None:
    tok = hf[name]
    vocab_size = tok._tok.get_vocab_size()
    _assert_exact(tok, data.draw(st.lists(st.integers(0, vocab_size - 1), max_size=40)))


@pytest.mark.parametrize("name", ["bpe", "wordpiece", "sentencepiece"])
@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_ids_beyond_the_tokenizers_vocabulary_are_skipped_as_decode_does(
    hf: dict[str, HFTokenizer], name: str, data: st.DataObject
) -> None:
    """A model's vocabulary may be larger than its tokenizer's (padded rows): an id the tokenizer does not
    know must not end a byte-fallback run that decode joins across it."""
    tok = hf[name]
    known = tok._tok.get_vocab_size(with_added_tokens=True)
    _assert_exact(tok, data.draw(st.lists(st.integers(0, known + 40), max_size=40)))


def test_an_unknown_id_inside_a_byte_run(hf: dict[str, HFTokenizer]) -> None:
    tok = hf["sentencepiece"]
    beyond = tok._tok.get_vocab_size(with_added_tokens=True) + 5
    _assert_exact(tok, [3 + ord("|"), beyond, 3 + 0xCD])  # decode: "\ufffd\ufffd", the run is whole


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([*BPE_WORDS, " ", "x", *MULTI_BYTE]), max_size=20).map("".join))
def test_bpe_text_round_trips_without_replacement(hf: dict[str, HFTokenizer], text: str) -> None:
    tok = hf["bpe"]
    deltas = _assert_exact(tok, tok.encode(text))
    assert "".join(deltas) == text and all("\ufffd" not in d for d in deltas)


def test_bpe_merge_that_cuts_an_emoji_is_held(hf: dict[str, HFTokenizer]) -> None:
    tok, b2c = hf["bpe"], byte_to_char()
    first, second, third, fourth = "🙂".encode()
    pieces = ["hello", b2c[first] + b2c[second], b2c[third], b2c[fourth]]  # 🙂 cut after 2 of its 4 bytes
    ids = [tok._tok.token_to_id(p) for p in pieces]
    assert None not in ids
    assert _assert_exact(tok, ids) == ["hello", "", "", "🙂"]


def test_wordpiece_continuations_and_specials(hf: dict[str, HFTokenizer]) -> None:
    tok = hf["wordpiece"]
    ids = tok.encode("The queue grows, workers grow!")
    assert ids[0] == WORDPIECE_VOCAB.index("[CLS]") and ids[-1] == WORDPIECE_VOCAB.index("[SEP]")
    deltas = _assert_exact(tok, ids)
    assert deltas == ["", "the", " queue", " grow", "s", ",", " work", "er", "s", " grow", "!", ""]


def test_sentencepiece_byte_run_is_held_until_it_ends(hf: dict[str, HFTokenizer]) -> None:
    tok = hf["sentencepiece"]
    byte_ids = [3 + b for b in "€".encode()]  # <0xE2> <0x82> <0xAC>
    ids = [tok._tok.token_to_id("▁the"), *byte_ids, tok._tok.token_to_id("s")]
    deltas = _assert_exact(tok, ids)
    assert deltas == ["the", "", "", "", "€s"]
    # a later invalid byte turns the whole run into U+FFFD: nothing of it was emitted before
    _assert_exact(tok, [*ids[:-1], 3 + 0xFF, ids[-1]])


# -- bounded work per token ------------------------------------------------------------------------


class _Spy:
    """Counts the ids each decode call sees."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.longest = 0

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        self.longest = max(self.longest, len(ids))
        return self.tok.decode(ids)


@pytest.mark.parametrize("name", ["byte", "bpe", "wordpiece"])
def test_each_step_decodes_a_bounded_window(hf: dict[str, HFTokenizer], name: str) -> None:
    tok: Tokenizer = BYTE if name == "byte" else hf[name]
    text = ("the queue grows 🙂 日本 hello world naïve € " * 60).strip()
    ids = tok.encode(text)
    assert len(ids) > 500
    spy = _Spy(tok)
    detok = IncrementalDetokenizer(spy)
    for i in ids:
        detok.add(i)
    assert detok.text + detok.flush() == tok.decode(ids)
    assert spy.longest <= 8  # a character's bytes plus one token of context, not the sequence


def test_byte_offset_is_the_first_byte() -> None:
    assert IncrementalDetokenizer(BYTE).add(BYTE_OFFSET + ord("A")) == "A"
