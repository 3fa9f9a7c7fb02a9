"""Prefix reuse on real decoders: the same greedy tokens with the prefix cache on and off, across turns.

The project's GPT-style and Llama-style (grouped-query) demo decoders run six three-turn
conversations through a real generation loop twice, once with the prefix cache and once without;
every turn's tokens must be equal, and from turn 2 on every prompt must reuse its conversation's
earlier tokens (hits counted by the cache). The same check on optimum's exports is in
``tests/optimum/test_prefix_reuse_optimum.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from protocol.modelcard import load_card
from tests.integration.multiturn import Conversations, make_loop, run_turns

MODELS = ("demo-lm", "demo-llama")


@pytest.mark.parametrize("name", MODELS)
def test_greedy_tokens_are_the_same_with_and_without_prefix_reuse(model_dir: Path, name: str) -> None:
    path = model_dir / name / f"{name}-1.0.0.onnx"
    talk = Conversations(count=6, turns=3, vocab=load_card(path).vocab_size)
    plain = make_loop(path, prefix_cache_bytes=0)
    reusing = make_loop(path, prefix_cache_bytes=64 << 20)
    assert plain.prefix_cache is None
    assert reusing.prefix_cache is not None, f"{name}: the graph cannot start from a past"

    expected = run_turns(plain, talk)
    got = run_turns(reusing, talk)

    for turn, (want, have) in enumerate(zip(expected, got, strict=True)):
        assert have == want, f"{name} turn {turn + 1}: tokens differ with prefix reuse"
    cache = reusing.prefix_cache
    later_prompts = talk.count * (talk.turns - 1)
    assert cache.hits == later_prompts, f"hits {cache.hits} of {cache.lookups} lookups"
    # every later turn reuses at least its conversation's previous prompt
    assert cache.tokens_reused >= sum(len(m) for turn in talk.messages[:-1] for m in turn)
    assert 0 < cache.bytes_held <= 64 << 20


def test_a_shared_prefix_joins_beside_fresh_prompts_in_one_prefill(model_dir: Path) -> None:
    """Rows with and without a hit in one prefill call (an empty past beside a cached one)."""
    path = model_dir / "demo-llama" / "demo-llama-1.0.0.onnx"
    vocab = load_card(path).vocab_size
    talk = Conversations(count=2, turns=2, vocab=vocab, seed=3)
    plain, reusing = make_loop(path, prefix_cache_bytes=0), make_loop(path, prefix_cache_bytes=64 << 20)
    assert run_turns(plain, talk) == run_turns(reusing, talk)
    fresh = Conversations(count=3, turns=1, vocab=vocab, seed=4)
    fresh.messages[0][0] = talk.messages[0][0] + fresh.messages[0][0]  # shares turn 1's first prompt
    hits_before = reusing.prefix_cache.hits if reusing.prefix_cache else 0
    assert run_turns(plain, fresh) == run_turns(reusing, fresh)
    assert reusing.prefix_cache is not None and reusing.prefix_cache.hits == hits_before + 1
