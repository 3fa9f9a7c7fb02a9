"""Train a small BERT-style WordPiece ``tokenizer.json`` on a corpus embedded in this module.

The tokenizer lower-cases and strips accents (``BertNormalizer``), splits on whitespace and
punctuation (``BertPreTokenizer``), and its post-processor wraps every text as
``[CLS] text [SEP]`` (pairs: ``[CLS] a [SEP] b [SEP]`` with type ids 0/1). Special ids are fixed:
``[PAD]`` = 0, ``[UNK]`` = 1, ``[CLS]`` = 2, ``[SEP]`` = 3, ``[MASK]`` = 4. Learning is
deterministic: the same corpus and vocabulary size always give the same file.
"""

from __future__ import annotations

import string
from collections import Counter
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from tools.artifacts import write_atomic

__all__ = ["CORPUS", "SPECIAL_TOKENS", "train_wordpiece"]

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
"""Special tokens, in id order (``[PAD]`` is id 0, the model's pad id)."""

CORPUS = """\
A message queue sits between the programs that make requests and the programs that serve them.
Producers put small messages on the queue and go on with their work; workers take messages off the
queue when they are ready, compute the answer, and store it where the producer can find it later.
When more requests arrive than the workers can handle, the queue grows, and nothing is lost: the
extra work waits its turn. Adding another worker on another machine drains the queue faster.

Language models read text as a sequence of tokens. A tokenizer splits each word into pieces it knows,
so that rare words become several common pieces and no word is ever completely unknown. The model
turns every token into a vector, mixes the vectors with attention, and predicts the next token or a
summary of the whole text. Encoders look at every token at once; decoders look only backwards and
generate new text one token at a time, keeping a cache of keys and values from earlier steps.

Batching several requests together lets the processor do more useful work per step. Short sequences
are padded to the length of the longest one, and an attention mask tells the model which positions
are real and which are padding. A good scheduler waits a few milliseconds to collect a batch, but
never so long that a lonely request misses its deadline. The best batch size depends on the model,
the hardware, and how busy the system is, so it should be measured rather than guessed.

The weather was mild this morning, with a light breeze from the west and a few clouds over the hills.
Children walked to school along the river while the bakery on the corner opened its doors. By noon
the market was full of people buying apples, bread, cheese, and fresh flowers. In the evening the
lights of the harbour reflected on the water, and the last boats returned before the rain began.

Reliable systems expect failure. A worker may crash in the middle of a task, a network link may drop,
or a disk may fill up. Acknowledging a message only after its result is stored means that a crashed
worker's message is delivered again to another worker. Because the computation is deterministic,
doing it twice gives the same answer, and the client never notices that anything went wrong.

Numbers and symbols appear in text too: version 1.0.0, 42 requests per second, 3.5 milliseconds,
100% of the tests, user@example.com, and the path models/demo-lm/demo-lm-1.0.0.onnx. Punctuation,
such as commas, periods, question marks? and exclamation marks! is split into its own tokens.
"""
"""A few paragraphs of English (plus digits and punctuation) to learn the WordPiece vocabulary from."""


def train_wordpiece(path: Path, vocab_size: int, corpus: str = CORPUS) -> Tokenizer:
    """Learn a WordPiece vocabulary of at most ``vocab_size`` tokens and save the tokenizer to ``path``.

    The vocabulary is the special tokens, then every ASCII letter, digit and punctuation mark (and
    every other character of the corpus) both word-initial and as a ``##`` continuation, then the
    corpus's most frequent whole words, word-initial pieces and continuation pieces (frequency
    first, longer first, then alphabetical). The ``tokenizers`` library's own ``WordPieceTrainer`` is
    not used: it breaks frequency ties in hash-map order, so two runs give different vocabularies.

    Returns:
        The tokenizer (its vocabulary is smaller than ``vocab_size`` when the corpus runs out).

    Raises:
        ValueError: ``vocab_size`` cannot hold the special tokens and the alphabet.
    """
    tok = _bare_tokenizer({"[UNK]": 0})
    words = _word_counts(tok, corpus)
    alphabet = sorted(set(_ALWAYS) | {ch for word in words for ch in word})
    base = [*SPECIAL_TOKENS, *alphabet, *(f"##{ch}" for ch in alphabet)]
    if len(base) > vocab_size:
        raise ValueError(
            f"vocab_size={vocab_size} is too small for the WordPiece tokenizer: the special tokens and the "
            f"alphabet alone need {len(base)} ids"
        )
    ranked = sorted(_piece_counts(words).items(), key=lambda kv: (-kv[1], -len(kv[0]), kv[0]))
    vocab = list(base)
    seen = set(base)
    for piece, _count in ranked:
        if len(vocab) >= vocab_size:
            break
        if piece not in seen:
            vocab.append(piece)
            seen.add(piece)
    tok = _bare_tokenizer({piece: i for i, piece in enumerate(vocab)})
    tok.add_special_tokens(SPECIAL_TOKENS)  # already in the vocabulary: keeps their ids, marks them special
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    write_atomic(path, tok.to_str(pretty=True).encode())  # a concurrent build or reader never sees half a file
    return tok


_ALWAYS = string.ascii_lowercase + string.digits + string.punctuation


def _bare_tokenizer(vocab: dict[str, int]) -> Tokenizer:
    """A BERT-style WordPiece tokenizer over ``vocab`` without a post-processor."""
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True, strip_accents=True, clean_text=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    return tok


def _word_counts(tok: Tokenizer, corpus: str) -> Counter[str]:
    """Words of ``corpus`` as the tokenizer's normalizer and pre-tokenizer see them, with counts."""
    assert tok.normalizer is not None and tok.pre_tokenizer is not None
    text = tok.normalizer.normalize_str(corpus)
    return Counter(word for word, _span in tok.pre_tokenizer.pre_tokenize_str(text))


def _piece_counts(words: Counter[str]) -> Counter[str]:
    """Candidate pieces with corpus counts: whole words (any count), and word-initial pieces and
    ``##`` continuation pieces (substrings not at a word start) seen at least twice."""
    pieces: Counter[str] = Counter()
    for word, count in words.items():
        pieces[word] += count
        for i in range(len(word)):
            for j in range(i + 2, len(word) + (0 if i == 0 else 1)):
                pieces[word[i:j] if i == 0 else f"##{word[i:j]}"] += count
    return Counter({p: c for p, c in pieces.items() if c >= 2 or p in words})
