"""A chat prompt's token ids match transformers' ``apply_chat_template(..., tokenize=True)``.

The Llama-style tokenizer's post-processor prepends ``<s>`` to every encoding and the template writes
``{{ bos_token }}`` itself; transformers encodes the rendered text without special tokens, so the
prompt starts with exactly one BOS. :data:`TRANSFORMERS_IDS` were produced by transformers 4.57.6
(``PreTrainedTokenizerFast(tokenizer_file=..., bos_token="<s>", eos_token="</s>")``) on the tokenizer
``sentencepiece_bpe(add_bos=True)`` builds, with :data:`TEMPLATE` and :data:`MESSAGES`;
``tests/optimum/test_chat_vs_transformers.py`` recomputes them with transformers itself.
"""

from __future__ import annotations

from pathlib import Path

from gateway.chat import ChatTemplate, render_chat
from protocol.tokenization import HFTokenizer
from tests.unit.tiny_tokenizers import sentencepiece_bpe

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}<<SYS>>{{ m['content'] }}<</SYS>>"
    "{% elif m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]{% else %} {{ m['content'] }}{{ eos_token }}"
    "{% endif %}{% endfor %}"
)
"""Llama 2's shape: BOS written by the template, EOS after each assistant turn."""

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "the queue"},
    {"role": "assistant", "content": "queues"},
    {"role": "user", "content": "日本 🙂"},
]

TRANSFORMERS_IDS = [
    1, 262, 63, 63, 86, 92, 86, 65, 65, 69, 104, 262, 101, 117, 108, 104, 105, 49, 63, 63, 50, 86, 92, 86, 65, 65,
    94, 76, 81, 86, 87, 96, 262, 119, 107, 104, 262, 116, 120, 104, 120, 104, 262, 94, 50, 76, 81, 86, 87, 96, 262,
    116, 120, 104, 120, 104, 261, 2, 262, 94, 76, 81, 86, 87, 96, 262, 233, 154, 168, 233, 159, 175, 262, 243, 162,
    156, 133, 262, 94, 50, 76, 81, 86, 87, 96,
]  # fmt: skip


def test_a_rendered_chat_prompt_has_one_bos_as_in_transformers(tmp_path: Path) -> None:
    tok = HFTokenizer(sentencepiece_bpe(tmp_path / "tokenizer.json", add_bos=True))
    assert tok.encode("the queue")[0] == 1, "the post-processor adds BOS to plain text"
    text = render_chat(ChatTemplate(TEMPLATE, bos_token="<s>", eos_token="</s>"), MESSAGES)
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == TRANSFORMERS_IDS
    assert ids.count(1) == 1
