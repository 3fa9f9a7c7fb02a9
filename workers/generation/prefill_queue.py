"""Chunked prefill: joining sequences whose prompts are computed over several steps, within a token budget.

A sequence admitted to the generation loop is prefilled before it joins the running batch. With
``batching.prefill_chunk_tokens`` > 0 the loop computes at most that many prompt tokens per step, over
all joining sequences (oldest first): a long prompt, or a burst of them, is prefilled a chunk per
step while the running sequences keep decoding, so their inter-token time stays one decode step plus
one bounded chunk. A chunk starts from the KV of the chunks before it (the same past-taking prefill
as prefix reuse, :meth:`~workers.generation.decoder.Decoder.prefill`), so tokens are the same as
with a whole-prompt prefill. The sequence joins the running batch, with its first token, at the
step that computes its last prompt token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from workers.generation.prefix_cache import PrefixHit
from workers.generation.sequence import GenSequence

__all__ = ["Joining", "plan_chunks"]


def plan_chunks(remaining: Sequence[int], budget: int) -> list[int]:
    """Tokens to compute this step for each joining sequence (oldest first), ``remaining[i]`` still to do.

    ``budget`` 0 = no cap (every prompt whole). Otherwise the oldest take what they need until the budget
    is spent; the one that spends it takes a part (pure).
    """
    if budget <= 0:
        return list(remaining)
    out = []
    left = budget
    for need in remaining:
        take = min(need, left)
        out.append(take)
        left -= take
    return out


@dataclass(eq=False)
class Joining:
    """A sequence being prefilled: how much of its prompt's KV is computed, and that KV."""

    seq: GenSequence
    done: int = 0
    """Prompt tokens whose KV is in ``kv`` (a prefix-cache hit counts)."""
    kv: Mapping[str, npt.NDArray[np.float32]] = field(default_factory=dict)
    """past name → ``[kv_heads, done, head_dim]``."""
    reused: int = 0
    """Of ``done``: tokens taken from the prefix cache."""
    started_mono: float | None = None
    """When its first chunk was computed (monotonic s)."""
    engine_ms: float = 0.0
    """Engine time of the prefill calls it took part in (ms)."""

    @property
    def remaining(self) -> int:
        """Prompt tokens still to compute."""
        return len(self.seq.prompt) - self.done

    def past(self) -> PrefixHit | None:
        """What the next chunk starts from (None: nothing computed yet)."""
        return PrefixHit(self.done, self.kv) if self.done else None
