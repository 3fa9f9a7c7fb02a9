"""The prefix cache's lookup, LRU byte bound and covered-entry rule (pure numpy, no model)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.prefix_digest import block_digests
from workers.generation.prefix_cache import PrefixCache

HEADS, DIM = 2, 3
ENTRY_BYTES_PER_TOKEN = 2 * HEADS * DIM * 4  # a key and a value, float32


def _kv(tokens: list[int]) -> dict[str, np.ndarray]:
    """A cache whose column j holds tokens[j] (so a reused slice shows which tokens it came from)."""
    col = np.asarray(tokens, dtype=np.float32)[None, :, None]
    key = np.broadcast_to(col, (HEADS, len(tokens), DIM)).copy()
    return {"k": key, "v": -key}


def test_the_longest_common_prefix_is_reused_and_one_token_is_left_to_compute() -> None:
    cache = PrefixCache(max_bytes=1 << 20, block_tokens=4)
    stored = list(range(10, 30))  # 20 tokens
    assert cache.insert(stored, _kv(stored))
    assert cache.bytes_held == 20 * ENTRY_BYTES_PER_TOKEN

    hit = cache.lookup([*range(10, 23), 99, 98])  # 13 shared tokens, then different
    assert hit is not None and hit.tokens == 13
    assert hit.kv["k"][0, :, 0].tolist() == list(range(10, 23))

    same = cache.lookup(stored)  # the whole entry asked again: the last token is computed
    assert same is not None and same.tokens == 19

    assert cache.lookup([10, 11, 12, 99, 1, 2, 3, 4]) is None  # less than one block shared
    assert cache.lookup([10, 11, 12, 13]) is None  # one block, but a hit must leave a token
    assert (cache.lookups, cache.hits, cache.tokens_reused) == (4, 2, 32)


def test_entries_are_dropped_least_recently_used_first_to_stay_within_max_bytes() -> None:
    per_entry = 8 * ENTRY_BYTES_PER_TOKEN
    cache = PrefixCache(max_bytes=2 * per_entry, block_tokens=4)
    a, b, c = ([base + i for i in range(8)] for base in (100, 200, 300))
    cache.insert(a, _kv(a))
    cache.insert(b, _kv(b))
    assert cache.lookup([*a, 1]) is not None  # a is now the most recently used
    cache.insert(c, _kv(c))
    assert cache.entries == 2 and cache.bytes_held == 2 * per_entry and cache.evictions == 1
    assert cache.lookup([*b, 1]) is None
    assert cache.lookup([*a, 1]) is not None and cache.lookup([*c, 1]) is not None


def test_an_entry_larger_than_the_bound_or_shorter_than_a_block_is_not_kept() -> None:
    cache = PrefixCache(max_bytes=4 * ENTRY_BYTES_PER_TOKEN, block_tokens=4)
    assert not cache.insert(list(range(5)), _kv(list(range(5))))
    assert not cache.insert([1, 2, 3], _kv([1, 2, 3]))
    assert cache.entries == 0 and cache.bytes_held == 0


def test_a_conversation_turn_replaces_the_turn_it_extends() -> None:
    cache = PrefixCache(max_bytes=1 << 20, block_tokens=4)
    turn1 = list(range(1, 13))
    turn2 = [*turn1, 50, 51, 52, 53, 54]
    cache.insert(turn1, _kv(turn1))
    cache.insert(turn2, _kv(turn2))
    assert cache.entries == 1 and cache.bytes_held == len(turn2) * ENTRY_BYTES_PER_TOKEN
    other = [*turn1[:8], 7, 7, 7, 7]  # shares two blocks only: both kept
    cache.insert(other, _kv(other))
    assert cache.entries == 2
    hit = cache.lookup([*turn2, 60])
    assert hit is not None and hit.tokens == len(turn2)


def test_stored_arrays_are_copies_of_what_was_offered() -> None:
    cache = PrefixCache(max_bytes=1 << 20, block_tokens=4)
    tokens = list(range(3, 11))
    kv = _kv(tokens)
    cache.insert(tokens, kv)
    kv["k"][:] = 0
    hit = cache.lookup([*tokens, 1])
    assert hit is not None and hit.kv["k"][0, :, 0].tolist() == tokens


def test_block_digests_are_chained_and_stable() -> None:
    first = block_digests([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(first) == 2
    assert block_digests([1, 2, 3, 4, 5, 6, 7, 8], 4) == first
    assert block_digests([0, 2, 3, 4, 5, 6, 7, 8], 4)[1] != first[1]  # a change in block 1 changes block 2's digest
    assert first[0].hex() == block_digests([1, 2, 3, 4], 4)[0].hex()


@settings(max_examples=200, deadline=None)
@given(
    stored=st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=24), max_size=6),
    prompt=st.lists(st.integers(0, 5), min_size=1, max_size=30),
)
def test_a_hit_is_always_a_true_prefix_of_the_prompt_and_of_what_was_stored(
    stored: list[list[int]], prompt: list[int]
) -> None:
    cache = PrefixCache(max_bytes=1 << 20, block_tokens=3)
    for tokens in stored:
        cache.insert(tokens, _kv(tokens))
    hit = cache.lookup(prompt)
    if hit is None:
        return
    assert 3 <= hit.tokens <= len(prompt) - 1
    assert hit.kv["k"][0, :, 0].astype(int).tolist() == prompt[: hit.tokens]
    assert cache.bytes_held == sum(
        ENTRY_BYTES_PER_TOKEN * n for n in [len(e.tokens) for e in cache._entries.values()]
    )


class _Recorder:
    def __init__(self) -> None:
        self.held: set[bytes] = set()
        self.events = 0

    def held_digests(self, digests: list[bytes]) -> None:
        assert not self.held & set(digests), "a digest announced twice"
        self.held |= set(digests)

    def released(self, digests: list[bytes]) -> None:
        assert set(digests) <= self.held, "a digest released that was never held"
        self.held -= set(digests)


@settings(max_examples=200, deadline=None)
@given(
    stored=st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=16), max_size=10),
    max_entries=st.integers(1, 4),
)
def test_the_listener_always_knows_exactly_the_digests_the_cache_holds(
    stored: list[list[int]], max_entries: int
) -> None:
    cache = PrefixCache(max_bytes=max_entries * 16 * ENTRY_BYTES_PER_TOKEN, block_tokens=2)
    recorder = _Recorder()
    cache.listener = type("L", (), {"held": lambda _, d: recorder.held_digests(d),
                                    "released": lambda _, d: recorder.released(d)})()
    for tokens in stored:
        cache.insert(tokens, _kv(tokens))
        assert recorder.held == set(cache.held_digests())
    cache.clear()
    assert recorder.held == set()
