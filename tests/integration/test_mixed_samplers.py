"""A decode step picks the greedy rows of a batch in one call; the other rows keep their own samplers.

The generation loop takes the argmax of every plain-greedy row (temperature 0, no repetition penalty)
in one ``numpy.argmax`` over the step's logits, and each other row's token from its own sampler
(repetition penalty on its history, a seeded draw). A batch that mixes them must give every request the
tokens it gets alone, on the demo Llama's in-place cache, with rows leaving at different steps (so
running order and slot order part ways) and a late joiner taking a freed slot.
"""

from __future__ import annotations

from pathlib import Path

from protocol.messages import GenerationParams
from tests.integration.multiturn import make_loop
from workers.generation.inplace_decoder import InPlaceDecoder
from workers.generation.loop import GenerationLoop
from workers.generation.sequence import GenSequence

PARAMS = [
    GenerationParams(max_new_tokens=9, temperature=0.0, ignore_eos=True, stream=False),
    GenerationParams(max_new_tokens=4, temperature=0.0, repetition_penalty=1.4, ignore_eos=True, stream=False),
    GenerationParams(max_new_tokens=11, temperature=0.9, seed=5, ignore_eos=True, stream=False),
    GenerationParams(max_new_tokens=3, temperature=0.0, ignore_eos=True, stream=False),
    GenerationParams(max_new_tokens=7, temperature=0.8, top_k=5, seed=9, ignore_eos=True, stream=False),
    GenerationParams(max_new_tokens=8, temperature=0.0, repetition_penalty=1.2, ignore_eos=True, stream=False),
]
LATE = GenerationParams(max_new_tokens=6, temperature=0.0, ignore_eos=True, stream=False)


def _seq(i: int, params: GenerationParams) -> GenSequence:
    return GenSequence(request_id=str(i), prompt=[5 + i, 17, 9 + 2 * i, 30], eos_ids=frozenset(), params=params)


def _run(loop: GenerationLoop, first: list[GenSequence], late: list[GenSequence], late_at_step: int) -> None:
    loop.step(first)
    steps = 1
    while loop.has_work() or late:
        joiners = late if steps == late_at_step else []
        late = [] if joiners else late
        loop.step(joiners)
        steps += 1


def test_a_batch_of_mixed_samplers_gives_each_request_its_tokens_alone(model_dir: Path) -> None:
    path = model_dir / "demo-llama" / "demo-llama-1.0.0.onnx"
    alone = []
    for i, params in enumerate([*PARAMS, LATE]):
        loop = make_loop(path, prefix_cache_bytes=0, max_batch_size=8)
        seq = _seq(i, params)
        _run(loop, [seq], [], 0)
        alone.append(seq.future.result(timeout=60).token_ids)
    loop = make_loop(path, prefix_cache_bytes=0, max_batch_size=8)
    assert loop.kv.in_place  # the slot cache: rows leave and join in place
    together = [_seq(i, p) for i, p in enumerate(PARAMS)]
    late = _seq(len(PARAMS), LATE)
    _run(loop, together, [late], late_at_step=5)  # after the 3- and 4-token rows left
    got = [s.future.result(timeout=60) for s in [*together, late]]
    assert [o.token_ids for o in got] == alone
    assert [len(t) for t in alone] == [p.max_new_tokens for p in [*PARAMS, LATE]]
    assert got[-1].batch_size_max < len(PARAMS) + 1 and got[0].batch_size_max == len(PARAMS)


def test_decode_steps_keep_one_binding_per_span_and_fresh_logits(model_dir: Path) -> None:
    """Steps over one span of slots reuse one binding (only ids, mask, positions and logits are rebound);
    a step's logits are its own (the next step does not write into them), and a new span binds anew."""
    loop = make_loop(model_dir / "demo-llama" / "demo-llama-1.0.0.onnx", prefix_cache_bytes=0, max_batch_size=4)
    decoder = loop.decoder
    assert isinstance(decoder, InPlaceDecoder)
    cache = decoder.new_cache(4)
    slots = cache.take(3)
    decoder.prefill_first(cache, slots, [[5, 6, 7], [8, 9], [10, 11, 12, 13]])
    first, _ = decoder.decode_slots(cache, {0: 11, 1: 12, 2: 13})
    kept = first.copy()
    assert decoder._step_binding is not None
    binding = decoder._step_binding[2]
    second, _ = decoder.decode_slots(cache, {0: 14, 1: 15, 2: 16})
    assert decoder._step_binding is not None and decoder._step_binding[2] is binding
    assert (first == kept).all() and not (second == first).all()
    cache.release(2)  # the span shrinks to 2 slots
    third, _ = decoder.decode_slots(cache, {0: 17, 1: 18})
    assert third.shape[0] == 2 and decoder._step_binding is not None and decoder._step_binding[2] is not binding
