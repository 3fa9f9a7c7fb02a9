"""The in-place KV cache: the rewrite, its load-time probe, and a generation loop on it.

- :func:`tools.inplace_kv.rewrite_inplace_kv` turns both demo decoders (GPT-style and Llama-style with
  grouped-query attention) into ``GroupQueryAttention`` graphs with no ``Concat`` on the cache, and the
  probe agrees with the original to float32 rounding (a dynamic INT8 graph, batch-dependent by nature,
  fails it and keeps its Concat cache); a graph it cannot match
  keeps the Concat cache under ``auto`` with the reason, and is refused under ``in_place``.
- A probe that disagrees (a rewrite with the wrong scale) makes ``auto`` fall back and ``in_place`` refuse.
- A continuous-batching run (sequences arriving at different steps, leaving at different steps,
  chunked prefill, prefix cache) gives the same greedy tokens in place as on the Concat cache, copies
  no KV bytes (without the prefix cache), and a join or a leave moves no other sequence's cache: the
  cache buffers never move and a running sequence's columns are unchanged by its neighbours' joins
  and leaves.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import numpy as np
import onnx
import pytest

import tools.inplace_kv
from protocol.errors import ModelLoadError
from protocol.messages import GenerationParams
from protocol.modelcard import load_card
from protocol.settings import BatchingSettings, EngineSettings, LimitSettings, ModelSettings
from tests.integration.multiturn import make_loop
from tools.inplace_kv import GQA_OP, rewrite_inplace_kv
from workers.engine import Engine
from workers.engines import _decoder
from workers.generation.batch_kv import SlotKV
from workers.generation.inplace_check import InPlaceMismatch, open_decoder
from workers.generation.inplace_decoder import InPlaceDecoder
from workers.generation.loop import GenerationLoop, GenStepStats
from workers.generation.sequence import GenSequence

NAMES = ("demo-llama", "demo-lm")


def _path(model_dir: Path, name: str) -> Path:
    return model_dir / name / f"{name}-1.0.0.onnx"


def _engine(path: Path, kv_cache: str = "auto", **engine: object) -> Engine:
    settings = EngineSettings(providers=["CPUExecutionProvider"], intra_op_threads=1, warmup=False,
                              kv_cache=kv_cache, **engine)  # type: ignore[arg-type]
    return Engine(path, load_card(path), settings, BatchingSettings(max_batch_size=4), LimitSettings())


@pytest.mark.parametrize("name", NAMES)
def test_the_rewrite_leaves_no_concat_on_the_cache_and_the_probe_agrees(model_dir: Path, name: str) -> None:
    path = _path(model_dir, name)
    card = load_card(path)
    original = onnx.load(str(path))
    rewritten = rewrite_inplace_kv(original, num_heads=card.num_heads, kv_heads=card.kv_heads, head_dim=card.head_dim)
    producers = {o: n for n in rewritten.graph.node for o in n.output}
    presents = [o.name for o in rewritten.graph.output if o.name.startswith("present.")]
    assert len(presents) == 2 * card.num_layers
    assert {producers[p].op_type for p in presents} == {GQA_OP}
    assert not any(n.op_type == "Concat" and any(i.startswith("past_key_values.") for i in n.input)
                   for n in rewritten.graph.node)
    assert tools.inplace_kv.has_inplace_attention(rewritten)
    # a graph that is already in place is accepted as it is
    again = rewrite_inplace_kv(rewritten, num_heads=card.num_heads, kv_heads=card.kv_heads, head_dim=card.head_dim)
    assert again.SerializeToString() == rewritten.SerializeToString()

    engine = _engine(path)
    assert engine.kv.in_place, engine.kv.reason
    decoder = open_decoder(engine)
    assert isinstance(decoder, InPlaceDecoder)
    assert decoder.probe_error is not None and decoder.probe_error < 1e-5


def test_the_cli_writes_an_in_place_file_that_a_worker_serves_as_it_is(model_dir: Path, tmp_path: Path) -> None:
    path = _copy_model(_path(model_dir, "demo-llama"), tmp_path)
    path.write_bytes(_path(model_dir, "demo-llama").read_bytes())
    assert tools.inplace_kv.main([str(path)]) == 0
    written = path.with_name("demo-llama-1.0.0-inplace.onnx")
    assert load_card(written).version == "1.0.0-inplace"
    engine = _engine(written)
    assert engine.kv.in_place and "already" in engine.kv.reason
    decoder = open_decoder(engine)
    assert isinstance(decoder, InPlaceDecoder) and decoder.probe_error is not None and decoder.probe_error < 1e-5


def _copy_model(source: Path, tmp_path: Path) -> Path:
    target = tmp_path / source.parent.name / source.name
    target.parent.mkdir(parents=True)
    for extra in source.parent.iterdir():
        if extra.suffix != ".onnx":
            (target.parent / extra.name).write_bytes(extra.read_bytes())
    return target


def test_a_dynamic_int8_graph_fails_the_probe_and_keeps_its_concat_cache(model_dir: Path, tmp_path: Path) -> None:
    """Dynamic INT8 quantizes activations with one scale per tensor, so a row's logits depend on its
    batch neighbours (about 2.5 % on this model, in the Concat form as well): the probe, which compares
    batched rows against sequences run alone, cannot vouch for it, and ``auto`` keeps the Concat cache."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    source = _path(model_dir, "demo-llama")
    target = _copy_model(source, tmp_path)
    quantize_dynamic(str(source), str(target), weight_type=QuantType.QInt8)
    engine = _engine(target)
    assert engine.kv.in_place, engine.kv.reason  # the attention itself is float: the rewrite matches
    with pytest.raises(InPlaceMismatch, match="probe differs"):
        open_decoder(engine)
    model = ModelSettings(path=target, engine=EngineSettings(providers=["CPUExecutionProvider"], warmup=False),
                          batching=BatchingSettings(max_batch_size=4))
    fallback, decoder = _decoder(engine, model)
    assert not fallback.kv.in_place and type(decoder).__name__ == "Decoder"


def test_a_graph_the_rewrite_does_not_match_keeps_the_concat_cache_or_is_refused(
    model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = _path(model_dir, "demo-lm")
    target = _copy_model(source, tmp_path)
    model = onnx.load(str(source))
    concat = next(n for n in model.graph.node if "present.1.value" in n.output)
    concat.input.reverse()  # Concat(new, past): not a cache the rewrite knows
    onnx.save(model, str(target))
    with caplog.at_level(logging.INFO, logger="fleet.engine"):
        engine = _engine(target)
    assert not engine.kv.in_place
    assert "layer 1: present.1.value is not Concat(past_key_values.1.value, new)" in engine.kv.reason
    assert "keeps the Concat KV cache" in caplog.text
    assert type(open_decoder(engine)).__name__ == "Decoder"
    with pytest.raises(ModelLoadError, match=r"engine\.kv_cache is in_place but the rewrite does not apply: layer 1"):
        _engine(target, "in_place")


def test_a_probe_that_disagrees_falls_back_under_auto_and_is_refused_under_in_place(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _path(model_dir, "demo-llama")
    real = tools.inplace_kv.rewrite_inplace_kv

    def wrong_scale(model: onnx.ModelProto, **sizes: int) -> onnx.ModelProto:
        out = real(model, **sizes)
        for node in out.graph.node:
            if node.op_type == GQA_OP:
                next(a for a in node.attribute if a.name == "scale").f = 2.0
        return out

    monkeypatch.setattr(tools.inplace_kv, "rewrite_inplace_kv", wrong_scale)
    engine = _engine(path)
    assert engine.kv.in_place
    with pytest.raises(InPlaceMismatch, match="probe differs from the original"):
        open_decoder(engine)
    model = ModelSettings(path=path, engine=EngineSettings(providers=["CPUExecutionProvider"], warmup=False),
                          batching=BatchingSettings(max_batch_size=4))
    fallback, decoder = _decoder(engine, model)
    assert not fallback.kv.in_place and type(decoder).__name__ == "Decoder"
    strict = model.model_copy(update={"engine": model.engine.model_copy(update={"kv_cache": "in_place"})})
    with pytest.raises(InPlaceMismatch):
        _decoder(_engine(path, "in_place"), strict)


def _arrivals(vocab: int, seed: int) -> list[tuple[int, list[int], int]]:
    """(step it arrives at, prompt, new tokens): 20 sequences, 1 to 60 prompt tokens, 2 to 30 new."""
    rng = random.Random(seed)
    out = [(rng.randint(0, 40), [rng.randrange(3, vocab) for _ in range(rng.randint(1, 60))], rng.randint(2, 30))
           for _ in range(20)]
    return sorted(out, key=lambda a: a[0])


def _run(loop: GenerationLoop, arrivals: list[tuple[int, list[int], int]],
         on_step: object = None) -> tuple[list[list[int]], list[GenStepStats]]:
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
        if callable(on_step):
            on_step(loop)
        step += 1
    return [s.future.result().token_ids for s in seqs], steps


@pytest.mark.parametrize(("name", "chunk", "prefix_bytes"), [
    ("demo-llama", 0, 0), ("demo-lm", 0, 0), ("demo-llama", 16, 64 << 20), ("demo-lm", 16, 64 << 20)])
def test_continuous_batching_in_place_gives_the_concat_caches_tokens(
    model_dir: Path, name: str, chunk: int, prefix_bytes: int
) -> None:
    path = _path(model_dir, name)
    arrivals = _arrivals(load_card(path).vocab_size, seed=3)
    concat = make_loop(path, prefix_cache_bytes=0, kv_cache="concat", max_batch_size=6)
    in_place = make_loop(path, prefix_cache_bytes=prefix_bytes, kv_cache="in_place", max_batch_size=6,
                         chunk_tokens=chunk)
    assert isinstance(in_place.kv, SlotKV) and not concat.kv.in_place

    want, concat_steps = _run(concat, arrivals)
    got, steps = _run(in_place, arrivals)

    assert got == want
    assert sum(s.kv_copied_bytes for s in concat_steps) > 0  # re-layouts and the graph's Concat of the past
    if not prefix_bytes:
        assert sum(s.kv_copied_bytes for s in steps) == 0
    assert max(s.running for s in steps) >= 3  # the batch really ran several sequences at once
    assert in_place.kv.cache.free == in_place.kv.cache.slots  # every slot came back


def test_a_join_or_a_leave_moves_no_other_sequences_cache(model_dir: Path) -> None:
    path = _path(model_dir, "demo-llama")
    loop = make_loop(path, prefix_cache_bytes=0, kv_cache="in_place", max_batch_size=6)
    kv = loop.kv
    assert isinstance(kv, SlotKV)
    addresses = {name: buf.ctypes.data for name, buf in kv.cache.buffers.items()}
    seen: dict[int, dict[str, np.ndarray]] = {}  # id(seq) -> its slot's columns after the last step
    changes = 0

    def check(loop: GenerationLoop) -> None:
        nonlocal changes
        members = {id(s): s for s in loop.running if s.slot is not None}
        if set(members) != set(seen):
            changes += 1
        for key, seq in members.items():
            assert seq.slot is not None
            now = {name: np.array(buf[seq.slot, :, : int(kv.cache.lengths[seq.slot]), :])
                   for name, buf in kv.cache.buffers.items()}
            if key in seen:  # its earlier columns are exactly as they were, whoever joined or left
                for name, before in seen[key].items():
                    assert np.array_equal(now[name][:, : before.shape[1], :], before), name
            seen[key] = now
        for key in set(seen) - set(members):
            del seen[key]

    _run(loop, _arrivals(load_card(path).vocab_size, seed=11), on_step=check)
    assert changes >= 10  # many joins and leaves happened
    assert {name: buf.ctypes.data for name, buf in kv.cache.buffers.items()} == addresses


def test_a_cache_the_cards_max_positions_makes_too_large_to_allocate_is_refused_naming_it(model_dir: Path) -> None:
    """The Llama graph bounds no position (its rotary angles are computed), so push takes any card's
    ``max_positions``; a worker then sizes each slot by it and must say which field asked for the memory,
    not raise a bare MemoryError (2**40 positions: 2 PiB, more than any address space)."""
    path = _path(model_dir, "demo-llama")
    card = load_card(path).model_copy(update={"max_positions": 2**40})
    settings = EngineSettings(providers=["CPUExecutionProvider"], intra_op_threads=1, warmup=False, kv_cache="in_place")
    engine = Engine(path, card, settings, BatchingSettings(max_batch_size=4), LimitSettings())
    decoder = open_decoder(engine)
    assert isinstance(decoder, InPlaceDecoder)
    needed = 2 * card.num_layers * 4 * card.kv_heads * 2**40 * card.head_dim * 4  # float32
    with pytest.raises(ModelLoadError) as refused:
        SlotKV(decoder, 4)
    assert refused.value.args[1:] == ("max_positions", 2**40)
    message = str(refused.value)
    assert f"demo-llama 1.0.0: the in-place KV cache of 4 slots x {2**40} tokens (the card's max_positions) " \
           f"needs {needed} bytes" in message, message
    assert isinstance(refused.value.__cause__, MemoryError)
