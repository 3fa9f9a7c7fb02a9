"""Tokenizers: text → token ids on the producer side (workers only ever see ids), ids → text for streams.

Two kinds, picked by the model card's ``tokenizer`` field (see :func:`load_tokenizer`):

* :class:`ByteTokenizer` (``"byte"``) — UTF-8 bytes shifted by 3 (0 = pad, 1 = bos, 2 = eos), so it
  needs a vocabulary of at least 259 ids. Every model built by ``fleet build-model`` can use it.
* :class:`HFTokenizer` (a path) — a Hugging Face ``tokenizer.json`` loaded with the ``tokenizers``
  library. The file's own padding and truncation are switched off: the fleet's ``limits`` are the
  only truncation, so it is reported (``truncated: true``) and pads never count as tokens.

A card that says ``"none"`` has no tokenizer: :func:`load_tokenizer` returns None and text is refused.
Both tokenizers refuse text that cannot be encoded as UTF-8 (lone surrogates such as ``"\\ud800"``,
which JSON can carry) with :class:`~protocol.errors.InvalidRequest` naming field ``text``.

:class:`IncrementalDetokenizer` turns generated ids into text deltas for streaming.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from protocol.errors import InvalidRequest, ModelLoadError
from protocol.modelcard import ModelCard
from protocol.utf8 import surrogate_message

if TYPE_CHECKING:
    from tokenizers import Tokenizer as _HFTokenizer

__all__ = [
    "BYTE_OFFSET",
    "ByteTokenizer",
    "HFTokenizer",
    "IncrementalDetokenizer",
    "Tokenizer",
    "load_tokenizer",
    "utf8_text",
]

BYTE_OFFSET = 3
"""Id of byte 0x00 in the byte-level vocabulary (ids 0, 1, 2 are pad, bos, eos)."""

_REPLACEMENT = "\ufffd"
"""What a decoder writes for bytes that are not (yet) a whole UTF-8 character."""

_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
"""A SentencePiece byte-fallback piece, e.g. ``<0xE2>``."""


class Tokenizer(Protocol):
    """Anything that turns text into ids and back."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def utf8_text(text: str) -> bytes:
    """``text`` as UTF-8 bytes.

    Raises:
        InvalidRequest: (field ``text``) ``text`` holds a lone surrogate (U+D800–U+DFFF, e.g. from a
            JSON ``"\\ud800"`` escape without its pair), which no UTF-8 text can contain.
    """
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(f"text is {surrogate_message(text, exc.start)}", "text", "UTF-8 encodable text") from None


class ByteTokenizer:
    """Byte-level tokenizer: one id per UTF-8 byte, offset by :data:`BYTE_OFFSET`."""

    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 2
    vocab_size = 256 + BYTE_OFFSET
    max_token_chars = 1
    """Characters one token can cover at most (one byte each): a text of n characters has >= n tokens."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Ids of ``text``'s UTF-8 bytes (no bos/eos added, whatever ``add_special_tokens`` says).

        Raises:
            InvalidRequest: ``text`` cannot be encoded as UTF-8 (see :func:`utf8_text`).
        """
        return [b + BYTE_OFFSET for b in utf8_text(text)]

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``; special and out-of-range ids are skipped, bad UTF-8 is replaced."""
        data = bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < 256 + BYTE_OFFSET)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (WordPiece, BPE, …) behind the :class:`Tokenizer` protocol.

    Padding and truncation saved in the file are disabled on load: a sentence-transformers export
    typically pads to and truncates at 128, which would count pads as real tokens and cut text
    without reporting it. Length limits are the fleet's (``limits.max_input_tokens`` and
    ``limits.truncate``, applied by :func:`protocol.validation.check_input`).
    """

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _HF  # imported lazily: only producers with text need it

        try:
            self._tok: _HFTokenizer = _HF.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception on bad files
            raise ModelLoadError(f"cannot load tokenizer {path}: {exc}", "tokenizer", str(path)) from exc
        self._tok.no_padding()
        self._tok.no_truncation()
        self.max_token_chars = _max_token_chars(self._tok)
        """Characters one token can cover at most (None: no bound, an unknown-word token may cover any
        run); ``len(text) / max_token_chars`` is then a lower bound on the tokens of ``text``."""
        self.special_ids = frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)
        """Ids that :meth:`decode` skips."""
        self.byte_fallback_ids = _byte_fallback_ids(self._tok)
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        """Ids below it are the tokenizer's; a model's vocabulary may be larger (padded), and
        :meth:`decode` skips the ids beyond it."""
        """Ids of ``<0xNN>`` byte pieces that the decoder joins into characters (SentencePiece/Llama
        ``ByteFallback``); empty when the decoder has no such step."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Ids of ``text``, with the special tokens the tokenizer's post-processor adds (a Llama
        tokenizer's BOS, BERT's ``[CLS]``/``[SEP]``) unless ``add_special_tokens`` is False; never
        padded or truncated. A prompt rendered by a chat template already holds the special tokens
        the template wrote (``{{ bos_token }}``), so it is encoded with ``add_special_tokens=False``,
        as transformers' ``apply_chat_template`` does.

        Raises:
            InvalidRequest: ``text`` cannot be encoded as UTF-8 (see :func:`utf8_text`).
        """
        utf8_text(text)  # the library would raise a bare TypeError
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` with special tokens skipped."""
        return str(self._tok.decode(ids, skip_special_tokens=True))


def _max_token_chars(tok: _HFTokenizer) -> int | None:
    """The most characters one token of ``tok`` covers: its longest vocabulary entry (markers such as
    ``##`` or ``▁`` counted, an over-estimate), or a WordPiece word cut to one ``[UNK]``; None where an
    unknown run of any length is one token (WordLevel, Unigram, BPE fusing unknowns without byte fallback)."""
    model = tok.model
    kind = type(model).__name__
    if kind in ("WordLevel", "Unigram") or (
        kind == "BPE" and getattr(model, "fuse_unk", False) and not getattr(model, "byte_fallback", False)
    ):
        return None
    longest = max((len(t) for t in tok.get_vocab(with_added_tokens=True)), default=1)
    return max(longest, int(getattr(model, "max_input_chars_per_word", 0) or 0))


def _byte_fallback_ids(tok: _HFTokenizer) -> frozenset[int]:
    decoder = tok.decoder
    if decoder is None or b'"ByteFallback"' not in decoder.__getstate__():
        return frozenset()
    return frozenset(i for piece, i in tok.get_vocab().items() if _BYTE_PIECE.fullmatch(piece))


def load_tokenizer(card: ModelCard, card_dir: Path) -> Tokenizer | None:
    """The tokenizer named by ``card.tokenizer``: ``'byte'``, ``'none'`` or a tokenizer.json path
    relative to ``card_dir``.

    Returns:
        None for ``'none'`` (the model has no tokenizer): callers refuse ``text`` with
        InvalidRequest naming field ``text`` and accept token ids only.

    Raises:
        ModelLoadError: the tokenizer file is missing or unreadable, or the byte tokenizer does
            not fit the model's vocabulary.
    """
    if card.tokenizer == "none":
        return None
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


class IncrementalDetokenizer:
    """Generated ids → text deltas, for streaming; exact and O(window) per token.

    ::

        detok = IncrementalDetokenizer(tokenizer)
        for token_id in generated:
            send(detok.add(token_id))   # may be "" (nothing new yet, or a character still incomplete)
        send(detok.flush())             # whatever was held back
        assert detok.text == tokenizer.decode(generated)

    Each step decodes only a window of recent ids (vLLM's and TGI's prefix/read offsets): the
    *prefix* ids ``[prefix_offset, read_offset)`` were already emitted and are decoded again only as
    context (a WordPiece ``##`` piece or a leading space depends on the token before it), and the
    delta is the decoded window minus the decoded prefix. While the window's text ends in U+FFFD
    (bytes of a character not yet complete, e.g. the first byte of an emoji) nothing is emitted and
    the offsets stay put; once the character is complete, all of it is released at once, so a
    multi-byte character is never split. The window therefore grows only while output is
    undecodable bytes.

    Exact (the deltas plus :meth:`flush` equal ``tokenizer.decode`` of every id) for the byte
    tokenizer and for ``tokenizer.json`` decoders whose output is a concatenation of per-token
    pieces where only the first piece is special: ByteLevel (BPE), WordPiece, Metaspace, none. A
    ``ByteFallback`` decoder turns a whole run of ``<0xNN>`` pieces into U+FFFDs when the run is
    not valid UTF-8, so a run is held back until a piece that is not a byte ends it.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._byte_pieces: frozenset[int] = frozenset()
        self._skipped: frozenset[int] = frozenset()
        self._known_below: int | None = None  # ids from here on are not the tokenizer's: decode skips them
        if isinstance(tokenizer, HFTokenizer):
            self._byte_pieces, self._skipped = tokenizer.byte_fallback_ids, tokenizer.special_ids
            self._known_below = tokenizer.vocab_size
        self._in_byte_run = False
        self._ids: list[int] = []  # the window: ids from prefix_offset on
        self._read = 0  # read_offset, relative to the window
        self._prefix_text = ""  # decode of the prefix ids [0, _read) of the window
        self._text = ""

    @property
    def text(self) -> str:
        """Everything :meth:`add` and :meth:`flush` returned so far, in order."""
        return self._text

    def add(self, token_id: int) -> str:
        """The text ``token_id`` adds (possibly ``""``: held back until a character is complete)."""
        self._ids.append(token_id)
        skipped = token_id in self._skipped or (self._known_below is not None and token_id >= self._known_below)
        if not skipped:  # skipped ids (specials, ids beyond the tokenizer's vocabulary) do not end a run
            self._in_byte_run = token_id in self._byte_pieces
        if self._in_byte_run:
            return ""
        window_text = self._tokenizer.decode(self._ids)
        if len(window_text) <= len(self._prefix_text) or window_text.endswith(_REPLACEMENT):
            return ""
        return self._emit(window_text)

    def flush(self) -> str:
        """Whatever :meth:`add` held back (an incomplete character comes out as U+FFFD); call it once,
        after the last token."""
        if self._read == len(self._ids):
            return ""
        return self._emit(self._tokenizer.decode(self._ids))

    def _emit(self, window_text: str) -> str:
        # Emitted text is always a prefix of window_text here: the prefix ids end on a complete
        # character and the decoders above only treat the window's first piece specially.
        delta = window_text[len(self._prefix_text) :]
        del self._ids[: self._read]  # the old prefix is no longer needed as context
        self._read = len(self._ids)
        self._prefix_text = self._tokenizer.decode(self._ids)
        self._text += delta
        return delta
