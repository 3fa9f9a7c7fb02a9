"""The in-place KV cache with its slots as ONNX Runtime values on the session's device.

On a GPU session the slot buffers are device memory (:class:`~workers.generation.slots.SlotCache` with a
``device``): decode steps bind addresses there, and the prefix cache's copies into and out of a slot go
through two small ONNX Runtime graphs (:mod:`workers.generation.slot_copy`). The same code runs on the CPU
provider with the device ``("cpu", 0)``, which is how these tests run it: every figure must equal the
numpy slots' (probe error, tokens across turns with prefix reuse, bytes copied). Which chain gets the
in-place cache (a GPU chain: a float16 graph and the CUDA provider) is decided from the graph alone, and
``auto`` falls back to the Concat cache when the in-place decoder cannot run its probe.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import ModelLoadError
from protocol.modelcard import load_card
from protocol.settings import BatchingSettings, EngineSettings, LimitSettings, ModelSettings
from tests.integration.multiturn import Conversations, make_loop, run_turns
from tools.build_llama import build_llama
from tools.build_lm import build_causal_lm
from tools.quantize import quantize_model
from tools.quantize_config import QuantizeConfig
from workers import engines
from workers.engine import Engine
from workers.generation import inplace_check
from workers.generation.inplace_check import InPlaceMismatch, probe_inplace
from workers.generation.inplace_decoder import InPlaceDecoder
from workers.generation.loop import GenerationLoop
from workers.generation.slots import SlotCache
from workers.inplace_graph import inplace_source

NAMES = ["past_key_values.0.key", "past_key_values.0.value", "past_key_values.1.key", "past_key_values.1.value"]
CUDA = ["CUDAExecutionProvider", "CPUExecutionProvider"]
TRT = ["TensorrtExecutionProvider", "CPUExecutionProvider"]
CPU = ["CPUExecutionProvider"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("device-slots")
    out: dict[str, Path] = {}
    fp16 = QuantizeConfig(mode="fp16", target="cuda", eval_count=8, latency_rounds=1, latency_prompts=2)
    for kind, build in (("lm", build_causal_lm), ("llama", build_llama)):
        out[f"{kind}-fp32"] = fp32 = build(root)
        path = quantize_model(fp32, fp16, progress=False).path
        assert path is not None
        out[f"{kind}-fp16"] = path
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_device_slots_copy_in_and_out_like_host_slots(dtype: type[np.floating]) -> None:
    shape = {"slots": 4, "kv_heads": 3, "capacity": 8, "head_dim": 5}
    host = SlotCache(NAMES, **shape, dtype=dtype)
    device = SlotCache(NAMES, **shape, dtype=dtype, device=("cpu", 0))
    assert device.on_device and not host.on_device and device.nbytes == host.nbytes == 4 * 4 * 3 * 8 * 5 * np.dtype(
        dtype).itemsize
    rng = np.random.default_rng(0)
    for slot, tokens in ((2, 5), (0, 8), (3, 1)):
        kv = {name: rng.standard_normal((3, tokens, 5)).astype(dtype) for name in NAMES}
        host.write(slot, kv)
        device.write(slot, kv)
        for name in NAMES:  # the whole buffer: the slot's columns and nothing else
            assert np.array_equal(device.values[name].numpy(), host.buffers[name])
        got = device.read(slot, tokens)
        assert all(np.array_equal(got[name], kv[name]) and got[name].dtype == dtype for name in NAMES)
        assert device.lengths[slot] == host.lengths[slot] == tokens
    assert (device.written_bytes, device.read_bytes) == (host.written_bytes, 3 * 4 * (5 + 8 + 1) * 5 * np.dtype(
        dtype).itemsize)
    base = device.values[NAMES[1]].data_ptr()
    assert device.pointer(NAMES[1], 3) == base + 3 * 3 * 8 * 5 * np.dtype(dtype).itemsize


_OPS = st.lists(st.one_of(
    st.tuples(st.just("take"), st.integers(1, 3)),
    st.tuples(st.just("write"), st.integers(0, 3), st.integers(0, 8)),
    st.tuples(st.just("read"), st.integers(0, 3), st.integers(0, 8)),
    st.tuples(st.just("release"), st.integers(0, 3)),
), min_size=1, max_size=24)  # fmt: skip


@settings(max_examples=60, deadline=None, database=None, derandomize=True)
@given(ops=_OPS, heads=st.integers(1, 3), half=st.booleans())
def test_any_sequence_of_slot_operations_leaves_device_slots_equal_to_host_slots(
        ops: list[tuple[object, ...]], heads: int, half: bool) -> None:
    """Takes, writes of 0..capacity tokens, reads and releases in any order, on both kinds of buffer."""
    dtype = np.float16 if half else np.float32
    shape = {"slots": 4, "kv_heads": heads, "capacity": 8, "head_dim": 2}
    host = SlotCache(NAMES[:2], **shape, dtype=dtype)
    device = SlotCache(NAMES[:2], **shape, dtype=dtype, device=("cpu", 0))
    rng = np.random.default_rng(len(ops))
    for op in ops:
        if op[0] == "take":
            count = min(int(op[1]), host.free)  # type: ignore[call-overload]
            assert device.take(count) == host.take(count)
        elif op[0] == "release":
            host.release(int(op[1]))  # type: ignore[call-overload]
            device.release(int(op[1]))  # type: ignore[call-overload]
        elif op[0] == "write":
            kv = {name: rng.standard_normal((heads, int(op[2]), 2)).astype(dtype) for name in NAMES[:2]}  # type: ignore[call-overload]
            host.write(int(op[1]), kv)  # type: ignore[call-overload]
            device.write(int(op[1]), kv)  # type: ignore[call-overload]
        else:
            want, got = host.read(int(op[1]), int(op[2])), device.read(int(op[1]), int(op[2]))  # type: ignore[call-overload]
            assert all(np.array_equal(got[name], want[name]) and got[name].dtype == dtype for name in NAMES[:2])
        assert np.array_equal(device.lengths, host.lengths) and device.span == host.span
    for name in NAMES[:2]:
        assert np.array_equal(device.values[name].numpy(), host.buffers[name])
    assert (device.written_bytes, device.read_bytes) == (host.written_bytes, host.read_bytes)


def _device_loop(path: Path, batching: BatchingSettings) -> tuple[GenerationLoop, float]:
    """A generation loop whose in-place decoder keeps its slots as ORT values (on the CPU device), and its
    probe error."""
    settings = EngineSettings(providers=CPU, intra_op_threads=1, warmup=False, kv_cache="in_place")
    engine = Engine(path, load_card(path), settings, batching, LimitSettings(max_input_tokens=1024))
    decoder = InPlaceDecoder(engine)
    decoder.slots_on_device = True
    error = probe_inplace(decoder, engine.concat_source)
    return GenerationLoop(decoder, batching), error


@pytest.mark.parametrize("name", ["llama-fp32", "llama-fp16", "lm-fp16"])
def test_generation_on_device_slots_equals_host_slots(models: dict[str, Path], name: str) -> None:
    path = models[name]
    batching = BatchingSettings(max_batch_size=8, prefix_cache_bytes=64 << 20, prefix_block_tokens=4)
    host = make_loop(path, prefix_cache_bytes=64 << 20, kv_cache="in_place")
    device, error = _device_loop(path, batching)
    assert device.kv.cache.on_device and not host.kv.cache.on_device  # type: ignore[attr-defined]
    assert error == host.decoder.probe_error  # type: ignore[attr-defined]
    talk = Conversations(count=4, turns=3, vocab=load_card(path).vocab_size)
    assert run_turns(device, talk) == run_turns(host, talk)
    assert device.prefix_cache is not None and host.prefix_cache is not None
    assert device.prefix_cache.hits == host.prefix_cache.hits == talk.count * (talk.turns - 1)
    dev_cache, host_cache = device.kv.cache, host.kv.cache  # type: ignore[attr-defined]
    assert dev_cache.written_bytes == host_cache.written_bytes > 0
    assert dev_cache.read_bytes == host_cache.read_bytes > 0


def _choice(path: Path, providers: list[str], kv_cache: str = "auto") -> tuple[bool, str]:
    choice = inplace_source(str(path), EngineSettings(kv_cache=kv_cache), load_card(path), providers)  # type: ignore[arg-type]
    return choice.in_place, choice.reason


def test_a_gpu_chain_gets_the_in_place_cache_for_a_float16_graph_with_the_cuda_provider(
        models: dict[str, Path]) -> None:
    assert _choice(models["llama-fp16"], CUDA)[0]
    assert _choice(models["llama-fp16"], ["TensorrtExecutionProvider", *CUDA])[0]
    assert _choice(models["llama-fp32"], CPU)[0] and _choice(models["llama-fp16"], CPU)[0]
    in_place, reason = _choice(models["llama-fp32"], CUDA)
    assert not in_place and "float16" in reason and "fleet quantize --target cuda" in reason
    in_place, reason = _choice(models["llama-fp16"], TRT)
    assert not in_place and "needs the CUDA provider" in reason
    with pytest.raises(ModelLoadError, match=r"engine\.kv_cache is in_place but .*float16"):
        _choice(models["llama-fp32"], CUDA, "in_place")
    graph = onnx.load(str(models["llama-fp16"])).graph
    assert {i.type.tensor_type.elem_type for i in graph.input if i.name.startswith("past")} == {
        onnx.TensorProto.FLOAT16}


def test_auto_serves_the_concat_cache_when_the_in_place_probe_cannot_run(
        models: dict[str, Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A fault in the probe (a device kernel or allocation that fails) is a fallback under ``auto`` and a
    refusal naming the exception under ``in_place``."""
    def fails(decoder: InPlaceDecoder, original: str | bytes) -> float:
        raise RuntimeError("CUDA failure 2: out of memory")

    monkeypatch.setattr(inplace_check, "probe_inplace", fails)
    path = models["llama-fp16"]
    for kv_cache in ("auto", "in_place"):
        model = ModelSettings(path=path, engine=EngineSettings(providers=CPU, warmup=False, kv_cache=kv_cache),
                              limits=LimitSettings(max_input_tokens=64))
        engine = Engine(path, load_card(path), model.engine, model.batching, model.limits)
        assert engine.kv.in_place
        if kv_cache == "in_place":
            with pytest.raises(InPlaceMismatch, match="could not run its probe: RuntimeError: CUDA failure 2"):
                engines._decoder(engine, model)
            continue
        with caplog.at_level(logging.WARNING, logger="fleet"):
            served, decoder = engines._decoder(engine, model)
        assert not served.kv.in_place and decoder is not None and not decoder.writes_in_place
        assert "keeps the Concat KV cache: the in-place decoder could not run its probe" in caplog.text
