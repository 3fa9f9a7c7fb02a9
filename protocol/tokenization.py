"""Tokenizers: text → token ids on the producer side (workers only ever see ids).

Two kinds:

* :class:`ByteTokenizer` — UTF-8 bytes shifted by 3 (0 = pad, 1 = bos, 2 = eos), so it needs a
  vocabulary of at least 259 ids. Every model built by ``fleet build-model`` can use it.
* :class:`HFTokenizer` — a Hugging Face ``tokenizer.json`` loaded with the ``tokenizers`` library,
  used when the model card names one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from protocol.errors import ModelLoadError
from protocol.modelcard import ModelCard

__all__ = ["BYTE_OFFSET", "ByteTokenizer", "HFTokenizer", "Tokenizer", "load_tokenizer"]

BYTE_OFFSET = 3
"""Id of byte 0x00 in the byte-level vocabulary (ids 0, 1, 2 are pad, bos, eos)."""


class Tokenizer(Protocol):
    """Anything that turns text into ids and back."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """Byte-level tokenizer: one id per UTF-8 byte, offset by :data:`BYTE_OFFSET`."""

    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 2
    vocab_size = 256 + BYTE_OFFSET

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``'s UTF-8 bytes (no bos/eos added)."""
        return [b + BYTE_OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``; special and out-of-range ids are skipped, bad UTF-8 is replaced."""
        data = bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < 256 + BYTE_OFFSET)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (WordPiece, BPE, …) behind the :class:`Tokenizer` protocol."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _HF  # imported lazily: only producers with text need it

        try:
            self._tok = _HF.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception on bad files
            raise ModelLoadError(f"cannot load tokenizer {path}: {exc}", "tokenizer", str(path)) from exc

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``, with the special tokens the tokenizer's post-processor adds."""
        return list(self._tok.encode(text).ids)

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` with special tokens skipped."""
        return str(self._tok.decode(ids, skip_special_tokens=True))


def load_tokenizer(card: ModelCard, card_dir: Path) -> Tokenizer:
    """The tokenizer named by ``card``: ``'byte'`` or a tokenizer.json path relative to ``card_dir``.

    Raises:
        ModelLoadError: the tokenizer file is missing or unreadable, or the byte tokenizer does
            not fit the model's vocabulary.
    """
    if card.tokenizer == "byte":
        if card.vocab_size < ByteTokenizer.vocab_size:
            raise ModelLoadError(
                f"byte tokenizer needs vocab_size >= {ByteTokenizer.vocab_size}, model has {card.vocab_size}",
                "vocab_size",
                ByteTokenizer.vocab_size,
            )
        return ByteTokenizer()
    path = card_dir / card.tokenizer
    if not path.exists():
        raise ModelLoadError(f"tokenizer file {path} not found", "tokenizer", str(path))
    return HFTokenizer(path)
