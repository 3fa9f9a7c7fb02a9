"""Drive a real :class:`~workers.generation.loop.GenerationLoop` through multi-turn conversations.

Each turn's prompt is the conversation so far (every earlier prompt and generated token) plus a
new seeded "user message"; the turns of all conversations are admitted together, as a worker's
scheduler would admit them, and stepped until every one ends. Shared by the prefix-reuse tests on
the project's own decoders and on optimum's exports.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from protocol.messages import GenerationParams
from protocol.modelcard import load_card
from protocol.settings import BatchingSettings, EngineSettings, LimitSettings
from workers.engine import Engine
from workers.generation.inplace_check import open_decoder
from workers.generation.loop import GenerationLoop
from workers.generation.sequence import GenSequence

__all__ = ["Conversations", "make_loop", "run_turns"]


def make_loop(
    path: Path, *, prefix_cache_bytes: int, block_tokens: int = 4, max_batch_size: int = 8, chunk_tokens: int = 0,
    kv_cache: Literal["auto", "in_place", "concat"] = "auto",
) -> GenerationLoop:
    """A CPU generation loop over ``path`` (one intra-op thread) with the prefix cache on or off (0), prefilling
    at most ``chunk_tokens`` prompt tokens per step (0: whole prompts), on the ``kv_cache`` a worker would
    open (``engine.kv_cache``)."""
    batching = BatchingSettings(
        max_batch_size=max_batch_size, prefix_cache_bytes=prefix_cache_bytes, prefix_block_tokens=block_tokens,
        prefill_chunk_tokens=chunk_tokens,
    )
    settings = EngineSettings(providers=["CPUExecutionProvider"], intra_op_threads=1, warmup=False, kv_cache=kv_cache)
    engine = Engine(path, load_card(path), settings, batching, LimitSettings(max_input_tokens=1024))
    return GenerationLoop(open_decoder(engine), batching)


@dataclass
class Conversations:
    """Seeded user messages: ``turns`` of ``count`` conversations, each message 3 to 12 ordinary ids."""

    count: int
    turns: int
    vocab: int
    seed: int = 11
    messages: list[list[list[int]]] = field(init=False)
    """``messages[turn][conversation]``."""

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        self.messages = [
            [[rng.randrange(3, self.vocab) for _ in range(rng.randint(3, 12))] for _ in range(self.count)]
            for _ in range(self.turns)
        ]


def run_turns(loop: GenerationLoop, talk: Conversations, max_new_tokens: int = 8) -> list[list[list[int]]]:
    """Every turn of ``talk`` through ``loop``, greedy; returns ``generated[turn][conversation]``."""
    history: list[list[int]] = [[] for _ in range(talk.count)]
    generated: list[list[list[int]]] = []
    params = GenerationParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True, stream=False)
    for turn, messages in enumerate(talk.messages):
        waiting = [
            GenSequence(request_id=f"{turn}-{c}", prompt=history[c] + messages[c], params=params, eos_ids=frozenset())
            for c in range(talk.count)
        ]
        pending = list(waiting)
        while pending or loop.has_work():
            count = loop.admissible(pending)
            joiners, pending = pending[:count], pending[count:]
            loop.step(joiners)
        outs = [seq.future.result().token_ids for seq in waiting]
        for c, seq in enumerate(waiting):
            history[c] = seq.prompt + outs[c]
        generated.append(outs)
    return generated
