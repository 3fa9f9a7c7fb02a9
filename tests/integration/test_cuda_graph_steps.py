"""Decode steps as CUDA graphs (``engine.cuda_graph``): fixed shapes at fixed addresses, one graph per span.

ONNX Runtime replays a captured graph with the addresses and shapes it was captured with, so the in-place
decoder's fixed steps (:attr:`~workers.generation.inplace_decoder.InPlaceDecoder.fixed_steps`) write each
step's ids, positions and a capacity-wide mask into buffers made once per span of slots and cache. What a CPU
can show of that, it shows here on the CPU provider with the same code: the tokens equal ordinary steps'
(multi-turn conversations with prefix reuse, joins and leaves, host and device slots, float32 and float16), a
span's buffers never move, a step's logits survive the next step, each span and cache has its own graph id,
and every other run says ``gpu_graph_id -1``. Capture itself needs the CUDA provider (docs/gpu.md).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from pydantic import ValidationError

from protocol.messages import GenerationParams
from protocol.modelcard import load_card
from protocol.settings import BatchingSettings, EngineSettings, LimitSettings
from tests.integration.multiturn import Conversations, run_turns
from tools.build_llama import build_llama
from tools.build_lm import build_causal_lm
from tools.quantize import quantize_model
from tools.quantize_config import QuantizeConfig
from workers.cuda_graph import NO_GRAPH, run_options
from workers.engine import Engine
from workers.generation import inplace_check
from workers.generation.inplace_check import open_decoder, probe_inplace
from workers.generation.inplace_decoder import InPlaceDecoder
from workers.generation.loop import GenerationLoop
from workers.generation.sequence import GenSequence
from workers.generation.slots import SlotCache
from workers.padding import pad_batch

CPU = ["CPUExecutionProvider"]
BATCHING = BatchingSettings(max_batch_size=8, prefix_cache_bytes=64 << 20, prefix_block_tokens=4)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cuda-graph-steps")
    fp16 = QuantizeConfig(mode="fp16", target="cuda", eval_count=8, latency_rounds=1, latency_prompts=2)
    lm16 = quantize_model(build_causal_lm(root), fp16, progress=False).path
    assert lm16 is not None
    return {"llama-fp32": build_llama(root), "lm-fp16": lm16}


def _engine(path: Path, **engine: object) -> Engine:
    settings = EngineSettings(**{"providers": CPU, "intra_op_threads": 1, "warmup": False, "kv_cache": "in_place",
                                 **engine})  # type: ignore[arg-type]
    return Engine(path, load_card(path), settings, BATCHING, LimitSettings(max_input_tokens=1024))


def _as_if_capturing(engine: Engine) -> Engine:
    """``engine`` with the run options a session that captures graphs gets (the CPU provider ignores them)."""
    engine.cuda_graph = True
    engine.run_options = run_options(NO_GRAPH)
    return engine


def _loop(path: Path, *, fixed: bool, device: bool) -> tuple[GenerationLoop, float]:
    decoder = InPlaceDecoder(_engine(path))
    decoder.fixed_steps, decoder.slots_on_device = fixed, device
    error = probe_inplace(decoder, decoder.engine.concat_source)
    return GenerationLoop(decoder, BATCHING), error


def _staggered(loop: GenerationLoop, vocab: int) -> list[list[int]]:
    """Ten greedy sequences of 1 to 12 prompt tokens and 2 to 17 new ones, one admitted per step (when a slot is
    free): they join running batches and leave at different steps, so the span of slots grows and shrinks."""
    rng = np.random.default_rng(3)
    waiting = [GenSequence(request_id=str(i), prompt=[int(t) for t in rng.integers(3, vocab, size=1 + i % 12)],
                           params=GenerationParams(max_new_tokens=2 + (7 * i) % 16, temperature=0.0, ignore_eos=True,
                                                   stream=False), eos_ids=frozenset()) for i in range(10)]
    pending = list(waiting)
    while pending or loop.has_work():
        count = min(1, loop.admissible(pending))
        joiners, pending = pending[:count], pending[count:]
        loop.step(joiners)
    return [seq.future.result().token_ids for seq in waiting]


@pytest.mark.parametrize("name", ["llama-fp32", "lm-fp16"])
def test_fixed_steps_give_the_tokens_of_ordinary_steps(models: dict[str, Path], name: str) -> None:
    """Staggered joins and leaves, then multi-turn conversations whose later turns start from cached prefixes."""
    path = models[name]
    vocab = load_card(path).vocab_size
    talk = Conversations(count=5, turns=3, vocab=vocab)
    ordinary, ordinary_error = _loop(path, fixed=False, device=False)
    want = (_staggered(ordinary, vocab), run_turns(ordinary, talk))
    for device in (False, True):
        fixed, error = _loop(path, fixed=True, device=device)
        assert error == ordinary_error
        assert (_staggered(fixed, vocab), run_turns(fixed, talk)) == want, f"device slots {device}"
        cache = fixed.kv.cache  # type: ignore[attr-defined]
        spans = fixed.decoder._fixed[cache]  # type: ignore[attr-defined]
        assert len(spans) > 3 and all(s.mask.shape() == [span, cache.capacity] for span, s in spans.items())
        assert fixed.decoder.transfers.tokens == ordinary.decoder.transfers.tokens


def test_a_spans_buffers_stay_at_one_address_and_each_steps_logits_are_its_own(models: dict[str, Path]) -> None:
    decoder = InPlaceDecoder(_engine(models["llama-fp32"]))
    decoder.fixed_steps = True
    cache = decoder.slot_cache(3, 32)
    cache.take(3)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    decoder.prefill_first(cache, [0, 1, 2], prompts)
    first, _ = decoder.decode_slots(cache, {0: 20, 1: 21, 2: 22})
    kept = first.copy()
    step = decoder._fixed[cache][3]
    addresses = [v.data_ptr() for v in (step.ids, step.mask, step.positions, step.logits)]
    second, _ = decoder.decode_slots(cache, {0: 30, 1: 31, 2: 32})
    assert decoder._fixed[cache][3] is step
    assert [v.data_ptr() for v in (step.ids, step.mask, step.positions, step.logits)] == addresses
    assert np.array_equal(first, kept) and not np.array_equal(first, second)
    # the second step's inputs are what the buffers hold: each row's total right-aligned in a 32-wide mask
    assert step.ids.numpy()[:, 0].tolist() == [30, 31, 32]
    assert step.positions.numpy()[:, 0].tolist() == [4, 3, 5]
    assert step.mask.numpy().sum(axis=1).tolist() == [5, 4, 6] and step.mask.numpy()[:, -1].tolist() == [1, 1, 1]
    cache.release(2)
    decoder.decode_slots(cache, {0: 40, 1: 41})  # the span shrinks to two slots: its own buffers
    assert set(decoder._fixed[cache]) == {2, 3}


def test_each_span_and_cache_has_its_own_graph_and_other_runs_have_none(
        models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _as_if_capturing(_engine(models["llama-fp32"]))
    runs: list[str | None] = []  # the gpu_graph_id of every run of the session, in order
    session = engine.session
    for method in ("run", "run_with_iobinding"):
        real = getattr(session, method)

        def spy(*args: object, real: Any = real, **kwargs: object) -> Any:
            options = [a for a in (*args, *kwargs.values()) if isinstance(a, ort.RunOptions)]
            runs.append(options[0].get_run_config_entry("gpu_graph_id") if options else None)
            return real(*args, **kwargs)

        monkeypatch.setattr(session, method, spy)
    engine.run(pad_batch([[5, 6, 7]], 0))  # a scoring or warm-up run
    decoder = open_decoder(engine)  # the probe's steps: a cache of its own, so graphs of its own
    assert isinstance(decoder, InPlaceDecoder) and decoder.fixed_steps
    assert engine.run_options is not None and engine.run_options.get_run_config_entry("gpu_graph_id") == "-1"
    taken = engine.next_graph_id()  # the probe's spans had ids 1 .. taken - 1
    assert taken >= 2
    cache = decoder.slot_cache(4, 64)
    cache.take(4)
    decoder.prefill_first(cache, [0, 1, 2, 3], [[5, 6], [7], [8, 9, 10], [11]])
    other = decoder.slot_cache(4, 64)
    other.take(2)
    decoder.prefill_first(other, [0, 1], [[5, 6], [7]])
    for _ in range(2):
        decoder.decode_slots(cache, {0: 3, 1: 4, 2: 5, 3: 6})
        decoder.decode_slots(other, {0: 3, 1: 4})
    cache.release(3)
    decoder.decode_slots(cache, {0: 3, 1: 4, 2: 5})

    def ids(c: SlotCache) -> dict[int, int]:
        return {span: int(s.options.get_run_config_entry("gpu_graph_id"))  # type: ignore[union-attr]
                for span, s in decoder._fixed[c].items()}

    assert ids(cache) == {4: taken + 1, 3: taken + 3} and ids(other) == {2: taken + 2}
    steps = [str(i) for i in range(taken + 1, taken + 3)] * 2 + [str(taken + 3)]
    # the scoring run, the probe (2 prefills, then steps over 3 slots: captured as graph 1 .. taken - 1), the
    # two prefills, then the steps
    assert runs[:3] == ["-1"] * 3 and set(runs[3:-7]) == {str(i) for i in range(1, taken)}
    assert runs[-7:] == ["-1", "-1", *steps]


def test_without_the_cuda_provider_the_steps_run_as_ever_and_the_reason_is_logged(
        models: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="fleet.engine"):
        engine = _engine(models["llama-fp32"], cuda_graph=True)
    assert not engine.cuda_graph and engine.run_options is None
    assert "has no CUDA provider" in str(engine.cuda_graph_reason)
    assert "engine.cuda_graph is on but decode steps run without CUDA graphs: the provider chain" in caplog.text
    decoder = open_decoder(engine)
    assert isinstance(decoder, InPlaceDecoder) and not decoder.fixed_steps


def test_a_probe_that_fails_as_graphs_falls_back_to_steps_without_them(
        models: dict[str, Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A capture the driver refuses at the probe's first steps: the worker keeps the in-place cache, its steps
    run kernel by kernel, and the reason is logged and kept."""
    real = inplace_check.probe_inplace

    def refuses_graphs(decoder: InPlaceDecoder, original: str | bytes) -> float:
        if decoder.fixed_steps:
            raise RuntimeError("CUDA failure 900: operation not permitted when stream is capturing")
        return real(decoder, original)

    monkeypatch.setattr(inplace_check, "probe_inplace", refuses_graphs)
    engine = _as_if_capturing(_engine(models["llama-fp32"]))
    with caplog.at_level(logging.WARNING, logger="fleet.engine"):
        decoder = open_decoder(engine)
    assert isinstance(decoder, InPlaceDecoder) and not decoder.fixed_steps
    assert decoder.probe_error is not None and decoder.probe_error < 1e-4
    assert "stream is capturing" in str(engine.cuda_graph_reason)
    assert "decode steps run without CUDA graphs" in caplog.text


@pytest.mark.parametrize("provider,option", [("CUDAExecutionProvider", "enable_cuda_graph"),
                                             ("TensorrtExecutionProvider", "trt_cuda_graph_enable")])
def test_graph_capture_through_provider_options_is_refused_naming_engine_cuda_graph(provider: str, option: str) -> None:
    with pytest.raises(ValidationError, match=rf"provider_options\.{provider}\.{option}: .*engine\.cuda_graph: true"):
        EngineSettings(provider_options={provider: {option: "1"}})
    assert EngineSettings(provider_options={provider: {option: "0"}}).provider_options[provider][option] == "0"
