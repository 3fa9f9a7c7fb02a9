"""Generation assets of the built LMs: generation_config.json and tokenizer_config.json (chat template).

Both layouts (GPT-style ``demo-lm``, Llama-style ``demo-llama``) must come with an EOS id, generation
defaults that :mod:`protocol.generation_config` reads back, and a chat template that renders in the
sandboxed Jinja2 environment transformers uses, to text the byte tokenizer can encode.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from protocol.generation_config import GenerationDefaults, load_chat_template, load_generation_defaults
from protocol.modelcard import load_card
from protocol.tokenization import ByteTokenizer
from tests.integration.decoder_harness import Decoder
from tools.build_llama import build_llama
from tools.build_lm import build_causal_lm
from tools.generation_assets import CHAT_TEMPLATE, DEFAULT_MAX_NEW_TOKENS

BUILDERS: dict[str, Callable[..., Path]] = {"demo-lm": build_causal_lm, "demo-llama": build_llama}

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": [{"type": "text", "text": "Hello"}, {"type": "image"}]},
    {"role": "user", "content": "Ça va?"},
]
RENDERED = (
    "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nHello<|end|>\n"
    "<|user|>\nÇa va?<|end|>\n"
)


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def built(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return BUILDERS[request.param](tmp_path_factory.mktemp("gen"))


def test_generation_defaults_read_back(built: Path) -> None:
    card = load_card(built)
    assert card.eos_token_id == ByteTokenizer.eos_token_id == 2
    assert load_generation_defaults(built, card) == GenerationDefaults(
        eos_token_ids=frozenset({2}), max_new_tokens=DEFAULT_MAX_NEW_TOKENS, temperature=0.0)
    doc = json.loads((built.parent / "generation_config.json").read_text())
    # The Llama-style model writes its EOS as a list (as Llama 3 does), the GPT-style one as an int.
    assert doc["eos_token_id"] == ([2] if card.num_kv_heads else 2)
    assert (doc["bos_token_id"], doc["pad_token_id"], doc["do_sample"]) == (1, 0, False)


def test_tokenizer_config(built: Path) -> None:
    doc = json.loads((built.parent / "tokenizer_config.json").read_text())
    assert load_chat_template(built) == doc["chat_template"] == CHAT_TEMPLATE
    assert (doc["bos_token"], doc["eos_token"], doc["pad_token"]) == ("<s>", "</s>", "<pad>")
    assert doc["model_max_length"] == load_card(built).max_positions


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_assets_are_reproducible(tmp_path: Path, name: str) -> None:
    a, b = (BUILDERS[name](tmp_path / d) for d in "ab")
    for file in ("generation_config.json", "tokenizer_config.json"):
        assert (a.parent / file).read_bytes() == (b.parent / file).read_bytes()


def _render(template: str, *, trim: bool = True, **context: Any) -> str:
    """Render in an immutable sandbox. ``trim``: as transformers does (trim_blocks + lstrip_blocks,
    loop controls); else a bare sandbox that fails on any undefined name."""
    jinja2 = pytest.importorskip("jinja2")
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = (ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
           if trim else ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined))
    return str(env.from_string(template).render(**context))


@pytest.mark.parametrize("trim", [True, False], ids=["transformers", "strict"])
def test_chat_template_renders_in_the_sandbox(built: Path, trim: bool) -> None:
    template = load_chat_template(built)
    assert template is not None
    with_prompt = _render(template, trim=trim, messages=CHAT, add_generation_prompt=True,
                          bos_token="<s>", eos_token="</s>")
    assert with_prompt == RENDERED + "<|assistant|>\n"
    assert _render(template, trim=trim, messages=CHAT, add_generation_prompt=False) == RENDERED
    assert _render(template, trim=trim, messages=[], add_generation_prompt=True) == "<|assistant|>\n"
    ids = ByteTokenizer().encode(with_prompt)
    card = load_card(built)
    assert all(3 <= i < card.vocab_size for i in ids)  # plain bytes: no special id slips in as text
    assert ByteTokenizer().decode(ids) == with_prompt


def test_generating_through_eos_breaks_nothing(built: Path) -> None:
    """Random weights rarely pick EOS; when one is picked (or a neighbour keeps going after it), EOS
    is an ordinary input: the cache grows, logits stay finite, and decoding skips it."""
    card = load_card(built)
    dec = Decoder(built, card)
    eos = load_generation_defaults(built, card).eos_token_ids
    prompt = ByteTokenizer().encode("<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n")
    ids = np.array([prompt], np.int64)
    logits, past = dec.run(ids, np.ones_like(ids), np.arange(len(prompt))[None])
    out: list[int] = []
    for step in range(6):
        token = min(eos) if step == 2 else int(logits[0, -1].argmax())  # force one EOS mid-way
        out.append(token)
        total = len(prompt) + len(out)
        logits, past = dec.run(np.array([[token]]), np.ones((1, total), np.int64), np.array([[total - 1]]), past)
        assert np.isfinite(logits).all() and past[0].shape[2] == total
    assert out[2] in eos
    assert ByteTokenizer().decode(out) == ByteTokenizer().decode([t for t in out if t not in eos])
