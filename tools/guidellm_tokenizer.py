"""Write a small byte-level BPE tokenizer in Hugging Face's format to the folder ``argv[1]``.

Run inside the guidellm tier's venv (it has ``tokenizers`` and ``transformers``): guidellm sizes its
synthetic prompts with a Hugging Face tokenizer, and the demo LM's own byte tokenizer is not one.
Nothing is downloaded.
"""

from __future__ import annotations

import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast


def main(folder: str) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet, special_tokens=["<eos>"])
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 4, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(folder)


if __name__ == "__main__":
    main(sys.argv[1])
