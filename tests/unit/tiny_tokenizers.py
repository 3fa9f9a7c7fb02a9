"""Factories of tiny ``tokenizer.json`` files built with the ``tokenizers`` library (no download).

Each writes the file and returns its path: a BERT-style WordPiece (``[CLS] … [SEP]``, ``##`` pieces),
a GPT-2-style byte-level BPE whose merges cut multi-byte characters (emoji, CJK) across tokens, and a
Llama-style SentencePiece BPE with ``<0xNN>`` byte-fallback pieces.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

__all__ = ["BPE_WORDS", "WORDPIECE_VOCAB", "byte_level_bpe", "byte_to_char", "sentencepiece_bpe", "wordpiece"]

WORDPIECE_VOCAB = [
    "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "queue", "grow", "##s", "##ing", "work", "##er",
    "don", "'", "t", "n", ".", ",", "?", "!", "do", "not", "a", "##b", "##", "日", "##本", "🙂", "##🙂",
    "\ufffd", "##\ufffd",
]  # fmt: skip
"""Words, ``##`` continuations, BERT-cleanup punctuation, CJK/emoji pieces and a literal U+FFFD."""

BPE_WORDS = ["hello", " world", " fleet", "🙂", " 🙂", "日本", "é", " naïve", "€"]
"""Words the byte-level BPE merges left to right (so ``🙂``'s first two bytes are a token too)."""


def wordpiece(path: Path, *, pad_to: int | None = None, truncate_at: int | None = None) -> Path:
    """A BERT-style WordPiece tokenizer; ``pad_to``/``truncate_at`` enable the file's own fixed-length
    padding and truncation, as a sentence-transformers export does."""
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(WORDPIECE_VOCAB)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    return _save(tok, path, pad_to, truncate_at, "[PAD]")


def byte_to_char() -> dict[int, str]:
    """GPT-2's byte → printable character map (the ByteLevel alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    table = {b: chr(b) for b in printable}
    table.update({b: chr(256 + n) for n, b in enumerate(others)})
    return table


def byte_level_bpe(path: Path, *, pad_to: int | None = None, truncate_at: int | None = None) -> Path:
    """A GPT-2-style byte-level BPE: the 256 byte pieces (ids 0–255), merges of :data:`BPE_WORDS`,
    then the special tokens ``<s>`` and ``</s>``."""
    b2c = byte_to_char()
    vocab = {b2c[b]: b for b in range(256)}
    merges: list[tuple[str, str]] = []
    for word in BPE_WORDS:
        chars = [b2c[b] for b in word.encode("utf-8")]
        piece = chars[0]
        for ch in chars[1:]:
            if piece + ch not in vocab:
                merges.append((piece, ch))
                vocab[piece + ch] = len(vocab)
            piece += ch
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    return _save(tok, path, pad_to, truncate_at, "</s>")


def sentencepiece_bpe(path: Path, *, add_bos: bool = False) -> Path:
    """A Llama-style tokenizer: ``▁`` word pieces, ``<0xNN>`` byte fallback, specials ``<unk>``/``<s>``/``</s>``;
    ``add_bos`` gives it Llama's post-processor, which prepends ``<s>`` (id 1) to every encoding."""
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)),
              "▁the", "▁queue", "s", "▁", "日本", "▁🙂", "ing"]  # fmt: skip
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
        )
    return _save(tok, path, None, None, "<unk>")


def _save(tok: Tokenizer, path: Path, pad_to: int | None, truncate_at: int | None, pad_token: str) -> Path:
    if pad_to is not None:
        tok.enable_padding(length=pad_to, pad_id=tok.token_to_id(pad_token), pad_token=pad_token)
    if truncate_at is not None:
        tok.enable_truncation(truncate_at)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path
