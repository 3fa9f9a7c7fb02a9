"""Prefix reuse on optimum's exports: greedy tokens identical with the prefix cache on and off, across turns.

optimum's Llama (grouped-query attention) and GPT-2 exports (``conftest.py``) run eight four-turn
conversations through a real generation loop with and without the prefix cache. Each turn's prompt
is the whole conversation so far plus a new message, so from turn 2 on a prompt's prefix is the
previous turn's prompt and reply, whose KV the cache kept when that turn ended: every turn's tokens
must be equal, and every later turn must have started from its conversation's cached prefix. The loop
without reuse runs the export's own Concat cache, the one with reuse the in-place cache (prefix hits
written into a sequence's slot).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integration.multiturn import Conversations, make_loop, run_turns

pytestmark = [pytest.mark.optimum, pytest.mark.timeout(900)]


@pytest.mark.parametrize("model", ["hf-llama", "hf-gpt2"])
def test_greedy_tokens_are_identical_with_prefix_reuse_across_turns(
    exports: tuple[Path, dict[str, Any]], model: str
) -> None:
    out, refs = exports
    path = out / refs["models"][model]["onnx"]
    talk = Conversations(count=8, turns=4, vocab=1000, seed=5)
    plain = make_loop(path, prefix_cache_bytes=0, kv_cache="concat")
    reusing = make_loop(path, prefix_cache_bytes=64 << 20, kv_cache="in_place")
    assert reusing.prefix_cache is not None, f"{model}: the export cannot start from a past"
    assert reusing.kv.in_place and not plain.kv.in_place

    expected = run_turns(plain, talk, max_new_tokens=10)
    got = run_turns(reusing, talk, max_new_tokens=10)

    for turn, (want, have) in enumerate(zip(expected, got, strict=True)):
        differing = [c for c, (w, h) in enumerate(zip(want, have, strict=True)) if w != h]
        assert not differing, f"{model} turn {turn + 1}: conversations {differing} differ with prefix reuse"
    cache = reusing.prefix_cache
    assert cache.hits == talk.count * (talk.turns - 1), f"{cache.hits} hits of {cache.lookups} lookups"
    share = cache.tokens_reused / cache.tokens_looked_up
    print(f"\n{model}: {cache.tokens_reused} of {cache.tokens_looked_up} prompt tokens reused ({share:.0%}), "
          f"{cache.entries} entries, {cache.bytes_held} bytes")
    assert share > 0.5  # turns 2-4 carry the whole history: most prompt tokens are reused
