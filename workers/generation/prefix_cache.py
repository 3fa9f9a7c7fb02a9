"""Prefix reuse: the KV of finished sequences, kept by token prefix, so a new prompt skips their prefill.

A worker's :class:`PrefixCache` holds entries ``(tokens, kv)``: ``kv[name]`` is
``[kv_heads, len(tokens), head_dim]``, the real cache columns of ``tokens`` (what the running batch
held for a sequence when it left). Entries are found by **token-prefix blocks** of
``block_tokens``: every entry is indexed under a chained digest of each of its whole blocks
(``tokens[:block_tokens]``, ``tokens[:2*block_tokens]``, ...). :meth:`PrefixCache.lookup` walks the
prompt's blocks from the longest down, takes the first entry indexed there, and extends the match
token by token to the longest common prefix (the digest only finds candidates; tokens are compared).

At least one prompt token is always left to compute (its logits give the first new token), so a
hit reuses at most ``len(prompt) - 1`` tokens.

Bounds: ``max_bytes`` over all entries' arrays (least recently used out first); an entry larger than
the bound is not kept. An entry whose tokens are a prefix of a newer entry's is dropped when the
newer one is inserted (a conversation's turn t is covered by turn t+1).

A :class:`PrefixListener` hears which block digests the cache starts and stops holding (a digest
shared by several entries is held until the last of them goes): the worker publishes them for the
producers' prefix-aware routing (:mod:`workers.prefix_holder`).

Pure numpy, no locks: the scheduler thread is the only user (metrics read the counters).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from protocol.prefix_digest import block_digests

__all__ = ["PrefixCache", "PrefixHit", "PrefixListener"]

KV = dict[str, npt.NDArray[np.float32]]


class PrefixListener(Protocol):
    """Told of every change of the set of block digests a :class:`PrefixCache` holds (must not block)."""

    def held(self, digests: list[bytes]) -> None:
        """The cache now holds these digests' prefixes (none of them before)."""

    def released(self, digests: list[bytes]) -> None:
        """The cache no longer holds these digests' prefixes."""


@dataclass(frozen=True)
class PrefixHit:
    """A cached prefix of a prompt."""

    tokens: int
    """Prompt tokens whose KV is reused (the prompt's first ``tokens`` ids)."""
    kv: Mapping[str, npt.NDArray[np.float32]]
    """past name → ``[kv_heads, tokens, head_dim]`` (views of the entry: read, never write)."""


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    kv: KV
    digests: list[bytes]
    nbytes: int


class PrefixCache:
    """LRU of finished sequences' KV, bounded in bytes, found by token-prefix blocks."""

    def __init__(self, max_bytes: int, block_tokens: int = 16) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.max_bytes = max_bytes
        self.block_tokens = block_tokens
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._index: dict[bytes, dict[int, None]] = {}
        """block digest → ids of the entries holding that prefix (an ordered set, newest last)."""
        self._next_id = 0
        self.bytes_held = 0
        """Bytes of the arrays held now."""
        self.lookups = 0
        """Prompts looked up."""
        self.hits = 0
        """Lookups that reused at least one token."""
        self.tokens_looked_up = 0
        """Prompt tokens of every lookup (the denominator of the token hit rate)."""
        self.tokens_reused = 0
        """Prompt tokens whose prefill was skipped."""
        self.evictions = 0
        """Entries dropped for the byte bound."""
        self.listener: PrefixListener | None = None
        """Told of the digests held and released (the worker's routing publisher); None: nobody."""

    @property
    def entries(self) -> int:
        """Entries held now."""
        return len(self._entries)

    def _candidate(self, tokens: Sequence[int], usable: int) -> tuple[int, int] | None:
        """(entry id, blocks matched) of the longest indexed block prefix within ``usable`` tokens."""
        digests = block_digests(tokens[:usable], self.block_tokens)
        for k in range(len(digests) - 1, -1, -1):
            holders = self._index.get(digests[k])
            if holders:
                return next(reversed(holders)), k + 1
        return None

    def lookup(self, prompt: Sequence[int]) -> PrefixHit | None:
        """The longest cached prefix of ``prompt`` (at most ``len(prompt) - 1`` tokens), or None."""
        self.lookups += 1
        self.tokens_looked_up += len(prompt)
        usable = len(prompt) - 1
        found = self._candidate(prompt, usable)
        if found is None:
            return None
        entry_id, _ = found
        entry = self._entries[entry_id]
        limit = min(usable, len(entry.tokens))
        same = np.asarray(entry.tokens[:limit]) == np.asarray(prompt[:limit], dtype=np.int64)
        matched = int(limit if same.all() else np.argmin(same))
        if matched < self.block_tokens:
            return None  # a digest collision or a shorter match than one block: not worth a past
        self._entries.move_to_end(entry_id)
        self.hits += 1
        self.tokens_reused += matched
        return PrefixHit(matched, {name: array[:, :matched, :] for name, array in entry.kv.items()})

    def insert(self, tokens: Sequence[int], kv: Mapping[str, npt.NDArray[np.float32]]) -> bool:
        """Keep ``kv`` (``[kv_heads, len(tokens), head_dim]`` per name; copied) for ``tokens``.

        Returns False when it is not kept: shorter than one block, or larger than ``max_bytes``.
        Entries whose tokens are a prefix of ``tokens`` are dropped (this one covers them).
        """
        if len(tokens) < self.block_tokens:
            return False
        owned = {name: np.array(array[:, : len(tokens), :], copy=True) for name, array in kv.items()}  # its own type
        nbytes = sum(a.nbytes for a in owned.values())
        if nbytes > self.max_bytes:
            return False
        key = tuple(int(t) for t in tokens)
        digests = block_digests(key, self.block_tokens)
        covered = {
            other
            for digest in digests
            for other in self._index.get(digest, ())
            if key[: len(self._entries[other].tokens)] == self._entries[other].tokens
        }
        entry_id = self._next_id
        self._next_id += 1
        self._entries[entry_id] = _Entry(key, owned, digests, nbytes)
        new = [digest for digest in digests if digest not in self._index]
        for digest in digests:
            self._index.setdefault(digest, {})[entry_id] = None
        if new and self.listener is not None:
            self.listener.held(new)
        self.bytes_held += nbytes
        for other in covered:  # after the new entry is indexed: their digests stay held
            self._drop(other)
        while self.bytes_held > self.max_bytes:
            oldest = next(iter(self._entries))
            self._drop(oldest)
            self.evictions += 1
        return True

    def held_digests(self) -> list[bytes]:
        """Every block digest the cache holds now."""
        return list(self._index)

    def clear(self) -> None:
        """Drop every entry (the model changed)."""
        for entry_id in list(self._entries):
            self._drop(entry_id)

    def _drop(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        self.bytes_held -= entry.nbytes
        gone = []
        for digest in entry.digests:
            holders = self._index[digest]
            del holders[entry_id]
            if not holders:
                del self._index[digest]
                gone.append(digest)
        if gone and self.listener is not None:
            self.listener.released(gone)
