"""The files that make a built causal LM ready to generate, in Hugging Face's formats.

Next to ``<name>-<version>.onnx`` in the model's folder (shared by every version in it, as in a
Hugging Face repository):

* ``generation_config.json`` — ``bos_token_id``, ``eos_token_id`` (an id or a list of ids),
  ``pad_token_id``, ``max_new_tokens`` (:data:`DEFAULT_MAX_NEW_TOKENS`) and ``do_sample: false``
  (greedy unless a request asks to sample);
* ``tokenizer_config.json`` — :data:`CHAT_TEMPLATE`, ``bos_token``/``eos_token``/``pad_token`` strings,
  ``model_max_length``.

The byte tokenizer has no special tokens: ``"<s>"`` typed as text becomes three byte ids, never id 1.
So the chat template writes its turn markers (``<|user|>``, ``<|end|>``, …) as plain text and never
uses ``bos_token``/``eos_token``; the fleet puts ids 1/2 in by id, from the card. Read them back with
:mod:`protocol.generation_config`.
"""

from __future__ import annotations

import json
from typing import Any

from protocol.modelcard import ModelCard

__all__ = [
    "CHAT_TEMPLATE",
    "DEFAULT_MAX_NEW_TOKENS",
    "GENERATION_CONFIG",
    "TOKENIZER_CONFIG",
    "generation_assets",
    "generation_config",
    "tokenizer_config",
]

GENERATION_CONFIG = "generation_config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"

DEFAULT_MAX_NEW_TOKENS = 64
"""``max_new_tokens`` of the built models' generation config (tokens)."""

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is iterable %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}"
    "{{ '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
"""Jinja2 chat template over ``messages`` (``role``, ``content``: a string or a list of
``{"type": "text", "text": …}`` parts) and ``add_generation_prompt``, in Hugging Face's convention::

    <|system|>\\nBe brief.<|end|>\\n<|user|>\\nHi<|end|>\\n<|assistant|>\\n

One line, newlines only inside string literals: it renders the same with or without
``trim_blocks``/``lstrip_blocks`` (transformers sets both) and needs no global beyond the variables."""


def generation_config(card: ModelCard, *, eos_token_id: int | list[int],
                      max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS) -> dict[str, Any]:
    """The ``generation_config.json`` document of ``card``'s model."""
    return {
        "bos_token_id": card.bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": card.pad_token_id,
        "max_new_tokens": max_new_tokens,
        "do_sample": False,
    }


def tokenizer_config(card: ModelCard) -> dict[str, Any]:
    """The ``tokenizer_config.json`` document of ``card``'s model (byte tokenizer)."""
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "model_max_length": card.max_positions,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def generation_assets(card: ModelCard, *, eos_token_id: int | list[int],
                      max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS) -> dict[str, bytes]:
    """``generation_config.json`` and ``tokenizer_config.json`` (file name -> bytes); same arguments → same bytes."""
    docs = {GENERATION_CONFIG: generation_config(card, eos_token_id=eos_token_id, max_new_tokens=max_new_tokens),
            TOKENIZER_CONFIG: tokenizer_config(card)}
    return {name: (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode() for name, doc in docs.items()}

