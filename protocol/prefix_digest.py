"""Token-prefix block digests: how a worker's prefix cache and the producers' router name a prefix.

A prompt's blocks are its whole runs of ``block_tokens`` ids from the start; digest ``k`` identifies
``tokens[:(k + 1) * block_tokens]`` (each digest chains the one before), so the same prefix gives the
same digests in every process and on every host, and holding digest ``k`` implies holding every
digest before it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

__all__ = ["DIGEST_BYTES", "block_digests"]

DIGEST_BYTES = 16
"""Length of one digest (blake2b, 128 bits)."""


def block_digests(tokens: Sequence[int], block_tokens: int) -> list[bytes]:
    """Chained digests of ``tokens``' whole blocks: item ``k`` identifies ``tokens[:(k+1)*block_tokens]``.

    blake2b over the previous digest and the block's ids as little-endian int64.

    Raises:
        ValueError: ``block_tokens`` < 1.
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    out: list[bytes] = []
    previous = b""
    ids = np.asarray(tokens, dtype="<i8")
    for k in range(len(tokens) // block_tokens):
        block = ids[k * block_tokens : (k + 1) * block_tokens].tobytes()
        previous = hashlib.blake2b(previous + block, digest_size=DIGEST_BYTES).digest()
        out.append(previous)
    return out
