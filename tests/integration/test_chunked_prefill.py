"""Chunked prefill on real decoders: the same greedy tokens, at most the budget of prompt tokens per step,
and the running sequences decode at every step while a long prompt is prefilled.

Sequences (prompts of 1 to 120 tokens) join a real generation loop at different steps, once with
whole-prompt prefills and once with a budget of 16 prompt tokens per step (with and without the
prefix cache); every sequence's tokens must be the same.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from protocol.messages import GenerationParams
from protocol.modelcard import load_card
from tests.integration.multiturn import make_loop
from workers.generation.loop import GenerationLoop, GenStepStats
from workers.generation.sequence import GenSequence

CHUNK = 16


def _arrivals(vocab: int) -> list[tuple[int, list[int], int]]:  # (step, prompt, new tokens)
    """(step it arrives at, prompt, new tokens): seeded; three long prompts among short ones."""
    rng = random.Random(9)
    out = []
    for i in range(14):
        length = rng.choice([120, 100, 75]) if i in (2, 7, 11) else rng.randint(1, 20)
        out.append((rng.randint(0, 30), [rng.randrange(3, vocab) for _ in range(length)], rng.randint(4, 12)))
    return sorted(out, key=lambda a: a[0])


Arrival = tuple[int, list[int], int]


def _run(loop: GenerationLoop, arrivals: list[Arrival]) -> tuple[list[list[int]], list[GenStepStats]]:
    steps: list[GenStepStats] = []
    loop.observers.append(steps.append)
    seqs = [GenSequence(request_id=str(i), prompt=p, eos_ids=frozenset(), params=GenerationParams(
        max_new_tokens=n, temperature=0.0, ignore_eos=True, stream=False)) for i, (_, p, n) in enumerate(arrivals)]
    waiting: list[GenSequence] = []
    step = 0
    while step <= arrivals[-1][0] or waiting or loop.has_work():
        waiting += [s for s, (at, _, _) in zip(seqs, arrivals, strict=True) if at == step]
        count = loop.admissible(waiting)
        joiners, waiting = waiting[:count], waiting[count:]
        loop.step(joiners)
        step += 1
    return [s.future.result().token_ids for s in seqs], steps


@pytest.mark.parametrize(("name", "prefix_cache_bytes"), [("demo-llama", 0), ("demo-lm", 0), ("demo-llama", 64 << 20)])
def test_chunked_prefill_gives_the_same_tokens_within_the_budget(
    model_dir: Path, name: str, prefix_cache_bytes: int
) -> None:
    path = model_dir / name / f"{name}-1.0.0.onnx"
    arrivals = _arrivals(load_card(path).vocab_size)
    whole, whole_steps = _run(make_loop(path, prefix_cache_bytes=0), arrivals)
    chunked_loop = make_loop(path, prefix_cache_bytes=prefix_cache_bytes, chunk_tokens=CHUNK)
    chunked, steps = _run(chunked_loop, arrivals)

    assert chunked == whole
    longest = max(len(p) for _, p, _ in arrivals)
    assert max(s.prefill_tokens for s in whole_steps) >= longest  # whole prompts: the longest in one step
    assert max(s.prefill_tokens for s in steps) <= CHUNK
    # the longest prompt took at least longest / CHUNK steps of prefill, and the batch kept decoding
    chunk_steps = [s for s in steps if s.prefill_tokens == CHUNK]
    assert len(chunk_steps) >= longest // CHUNK
    assert sum(1 for s in chunk_steps if s.running > 0) >= len(chunk_steps) - 2


def test_a_joining_sequence_cancelled_mid_prefill_ends_and_frees_its_slot(model_dir: Path) -> None:
    path = model_dir / "demo-llama" / "demo-llama-1.0.0.onnx"
    loop = make_loop(path, prefix_cache_bytes=0, chunk_tokens=CHUNK, max_batch_size=2)
    long = GenSequence(request_id="long", prompt=list(range(3, 103)), eos_ids=frozenset(),
                       params=GenerationParams(max_new_tokens=4, temperature=0.0, stream=False))
    loop.step([long])
    assert loop.joining and loop.has_work() and loop.admissible([long, long]) == 1  # it holds a slot
    long.cancel_requested = True
    loop.step([])
    outcome = long.future.result(timeout=1)
    assert outcome.finish_reason == "cancelled" and outcome.token_ids == []
    assert not loop.joining and not loop.has_work()
