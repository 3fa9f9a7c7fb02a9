"""Adversarial schedules through the real generation loops (the worker's :class:`GenerationLoops` over a real
ONNX Runtime decoder of the demo Llama, in place; no Redis, no worker): who waits, who is cancelled or expires
where, and what the worker then reports as generating.

- A generation cancelled (or past its deadline) while it waits behind a full batch ends at the next step,
  unrun, instead of holding its worker slot until the batch has room for it; it is not reported as an
  outcome of the version (a canary's error rate counts only what ran).
- A sequence being prefilled a chunk per step counts as generating (the heartbeat's ``generating``).
- Random joins, cancels at every phase, prompts at the context limit and extreme samplers: each request
  gets the tokens it gets alone (a cancelled one a prefix of them), every future resolves once, and the
  loop ends with no row, no joiner and every KV slot free.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.errors import RequestCancelled, RequestExpired
from protocol.messages import GenerationParams
from protocol.tokenization import ByteTokenizer
from tests.integration.multiturn import make_loop
from workers.generation.loop import GenerationLoop
from workers.generation.sequence import GenOutcome, GenSequence
from workers.generation_loops import GenerationLoops
from workers.jobs import JobOutcome, Served

TOKENIZER = ByteTokenizer()


def _llama(model_dir: Path) -> Path:
    return model_dir / "demo-llama" / "demo-llama-1.0.0.onnx"


def _seq(rid: str, prompt: list[int], **params: Any) -> GenSequence:
    params.setdefault("stream", False)
    return GenSequence(request_id=rid, prompt=prompt, params=GenerationParams(**params), eos_ids=frozenset({2}),
                       tokenizer=TOKENIZER)


def _loops(loop: GenerationLoop) -> tuple[GenerationLoops, Served]:
    return GenerationLoops(loop), Served(loop.decoder.engine, "1.0.0", "stable")


def _step(gens: GenerationLoops, served: Served) -> None:
    gens.step(gens.admit(served, None))


@pytest.fixture(scope="module")
def one_slot(model_dir: Path) -> GenerationLoop:
    """A loop of one sequence at a time (shared by the tests below; each leaves it empty)."""
    return make_loop(_llama(model_dir), prefix_cache_bytes=0, max_batch_size=1)


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_a_generation_ended_while_it_waits_behind_a_full_batch_leaves_at_the_next_step(
    one_slot: GenerationLoop, how: str
) -> None:
    gens, served = _loops(one_slot)
    running = _seq("running", [5, 6, 7], max_new_tokens=40, ignore_eos=True)
    waiting = _seq("waiting", [8, 9], max_new_tokens=3, ignore_eos=True)
    gens.waiting += [running, waiting]
    _step(gens, served)
    assert gens.active == 2 and not waiting.future.done()
    if how == "cancel":
        waiting.cancel_requested = True
    else:
        waiting.deadline_s = one_slot.clock() - 1.0
    _step(gens, served)
    assert waiting.future.done(), "still waiting for the running generation to leave"
    expected = RequestCancelled if how == "cancel" else RequestExpired
    assert isinstance(waiting.future.exception(), expected)
    assert not running.future.done() and gens.active == 1 and gens.waiting == []
    # refused unrun by its caller's cancel or deadline: not an outcome of the version (no canary error)
    reported: list[JobOutcome] = []
    gens.report_ended([reported.extend])
    assert reported == [], "a generation its caller ended before it ran was reported as the version failing"
    running.cancel_requested = True
    _step(gens, served)
    assert running.future.result().finish_reason == "cancelled" and gens.active == 0
    gens.report_ended([reported.extend])
    assert [(o.version, o.ok) for o in reported] == [("1.0.0", True)]  # it ran: its tokens are its result
    assert not one_slot.has_work() and one_slot.kv.cache.free == 1  # type: ignore[union-attr]


def test_a_sequence_prefilled_a_chunk_per_step_counts_as_generating(model_dir: Path) -> None:
    loop = make_loop(_llama(model_dir), prefix_cache_bytes=0, max_batch_size=2, chunk_tokens=4)
    gens, served = _loops(loop)
    long_prompt = _seq("long", list(range(3, 40)), max_new_tokens=2, ignore_eos=True)
    gens.waiting.append(long_prompt)
    _step(gens, served)
    assert loop.joining and not loop.running  # its prompt is part way through
    assert gens.active == 1, "a generation being prefilled is reported as not generating"
    while loop.has_work():
        _step(gens, served)
    assert long_prompt.future.result().finish_reason == "length" and gens.active == 0


# -- random schedules -------------------------------------------------------------------------------------------

SAMPLERS: list[dict[str, Any]] = [
    {"temperature": 0.0},
    {"temperature": 0.8, "top_p": 0.9},
    {"temperature": 100.0},
    {"temperature": 1e-310},  # subnormal: its logits / temperature overflow
    {"temperature": 1.0, "top_k": 1},
    {"temperature": 1.0, "top_k": 512},
    {"temperature": 1.0, "top_p": 1e-9},
    {"temperature": 0.7, "repetition_penalty": 1e-300},
    {"temperature": 0.0, "repetition_penalty": 9.9},
]
STOPS = [[], [], ["a"], ["\x10\x11"], ["\x7f\x80\x81"]]


@st.composite
def _workload(draw: st.DrawFn) -> list[tuple[list[int], dict[str, Any], int, int | None]]:
    """Requests: (prompt, params, step it arrives at, step it is cancelled at or None)."""
    out = []
    for i in range(draw(st.integers(2, 6))):
        length = draw(st.sampled_from([1, 2, 9, 30, 505]))  # 505: max_new_tokens <= 7 reach the 512 positions
        rng = random.Random(draw(st.integers(0, 2**16)))
        prompt = [rng.randrange(3, 259) for _ in range(length)]
        params = {**draw(st.sampled_from(SAMPLERS)), "seed": i, "ignore_eos": draw(st.booleans()),
                  "max_new_tokens": min(draw(st.sampled_from([1, 2, 5, 12])), 512 - length),
                  "stop": draw(st.sampled_from(STOPS))}
        cancel = draw(st.none() | st.integers(0, 14))
        out.append((prompt, params, draw(st.integers(0, 5)), cancel))
    return out


@pytest.fixture(scope="module")
def loops(model_dir: Path) -> Iterator[tuple[GenerationLoop, GenerationLoop]]:
    """(reference loop for runs alone, loop of 3 slots with 6-token prefill chunks and the prefix cache)."""
    path = _llama(model_dir)
    yield (make_loop(path, prefix_cache_bytes=0, max_batch_size=1),
           make_loop(path, prefix_cache_bytes=1 << 20, max_batch_size=3, chunk_tokens=6))


def _alone(loop: GenerationLoop, prompt: list[int], params: dict[str, Any]) -> GenOutcome:
    gens, served = _loops(loop)
    seq = _seq("alone", list(prompt), **params)
    gens.waiting.append(seq)
    while gens.waiting or loop.has_work():
        _step(gens, served)
    return seq.future.result()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(work=_workload())
def test_random_joins_and_cancels_give_each_request_its_tokens_alone_and_free_everything(
    loops: tuple[GenerationLoop, GenerationLoop], work: list[tuple[list[int], dict[str, Any], int, int | None]]
) -> None:
    reference, loop = loops
    alone = [_alone(reference, prompt, params) for prompt, params, _, _ in work]
    gens, served = _loops(loop)
    seqs = [_seq(str(i), list(prompt), **params) for i, (prompt, params, _, _) in enumerate(work)]
    step = 0
    while step < 20 or gens.waiting or loop.has_work():
        for seq, (_, _, arrive, cancel) in zip(seqs, work, strict=True):
            if arrive == step:
                gens.waiting.append(seq)
            if cancel == step:
                seq.cancel_requested = True
        _step(gens, served)
        step += 1
        assert step < 2000
    for seq, want, (prompt, _, _, cancel) in zip(seqs, alone, work, strict=True):
        assert seq.future.done()
        if seq.future.exception() is not None:  # cancelled before its prefill
            assert cancel is not None and isinstance(seq.future.exception(), RequestCancelled)
            continue
        got = seq.future.result()
        assert got.prompt_tokens == len(prompt)
        if got.finish_reason == "cancelled":
            assert cancel is not None and got.token_ids == want.token_ids[: len(got.token_ids)]
        else:
            assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    assert gens.active == 0 and not loop.running and not loop.joining
    assert loop.kv.cache.free == 3  # type: ignore[union-attr]
