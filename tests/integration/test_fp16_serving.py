"""Float16 models served: the file ``fleet quantize --target cuda`` writes, and any export whose KV cache is
float16 (optimum's ``--dtype fp16``).

Every array the worker made for the cache was float32 (the empty past of a prefill and of the placement
and warm-up runs, a re-laid-out batch, the in-place slots, the probe's reference, the prefix cache's
copies), so ONNX Runtime refused a float16 graph at load ("Unexpected input data type"). Now the cache
takes the graph's type (:mod:`workers.kv_dtype`): scoring, both KV caches, prefix reuse and a real worker
serve the float16 file, and the in-place cache holds half the bytes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from protocol.errors import ModelLoadError
from protocol.messages import GenerationParams
from protocol.modelcard import load_card
from protocol.settings import BatchingSettings, EngineSettings, LimitSettings
from tests.integration.fleet_fixtures import Fleet
from tests.integration.multiturn import Conversations, make_loop, run_turns
from tools.build_llama import build_llama
from tools.build_lm import build_causal_lm
from tools.quantize import quantize_model
from tools.quantize_config import QuantizeConfig
from workers.engine import Engine
from workers.generation.loop import GenerationLoop
from workers.generation.sequence import GenSequence
from workers.kv_dtype import kv_dtype
from workers.padding import pad_batch

FP16 = QuantizeConfig(mode="fp16", target="cuda", eval_count=16, latency_rounds=1, latency_prompts=4)
KINDS = ("lm", "llama")
CPU = ["CPUExecutionProvider"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The GPT-style and Llama-style demo LMs, FP32 and as ``fleet quantize --target cuda`` writes them."""
    root = tmp_path_factory.mktemp("fp16-models")
    out: dict[str, Path] = {}
    for kind, build in (("lm", build_causal_lm), ("llama", build_llama)):
        out[f"{kind}-fp32"] = fp32 = build(root)
        outcome = quantize_model(fp32, FP16, progress=False)
        assert outcome.path is not None and outcome.report["accuracy"]["top1_agreement"] >= 0.9
        out[f"{kind}-fp16"] = outcome.path
    return out


def _types(path: Path) -> dict[str, int]:
    graph = onnx.load(str(path)).graph
    return {v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.output]}


@pytest.mark.parametrize("kind", KINDS)
def test_the_fp16_file_keeps_what_clients_exchange_and_halves_the_rest(models: dict[str, Path], kind: str) -> None:
    path = models[f"{kind}-fp16"]
    types = _types(path)
    f16, f32, i64 = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT, onnx.TensorProto.INT64
    assert types["input_ids"] == i64 and types["logits"] == f32
    kv = {name: t for name, t in types.items() if name.startswith(("past_key_values.", "present."))}
    assert kv and set(kv.values()) == {f16}
    card = load_card(path)
    assert card.quantization == "fp16" and card.version == "1.0.0-fp16"
    assert path.stat().st_size < 0.6 * models[f"{kind}-fp32"].stat().st_size


def _engine(path: Path, **engine: Any) -> Engine:
    settings = EngineSettings(providers=CPU, intra_op_threads=1, **engine)
    return Engine(path, load_card(path), settings, BatchingSettings(max_batch_size=4),
                  LimitSettings(max_input_tokens=32))


@pytest.mark.parametrize("kind", KINDS)
def test_scoring_an_fp16_model_gives_fp32_logits_close_to_the_fp32_model(models: dict[str, Path], kind: str) -> None:
    """The ``fleet.infer`` path (placement run and warm-up included: both feed an empty past)."""
    half = _engine(models[f"{kind}-fp16"], warmup=True)
    full = _engine(models[f"{kind}-fp32"], warmup=True)
    assert half.kv_dtype is np.float16 and full.kv_dtype is np.float32
    half.warm_up()
    batch = pad_batch([[5, 17, 9, 30, 41], [7, 3], [100, 200, 300]], 0)
    got, want = half.run(batch), full.run(batch)
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()
    assert (got[:, -1].argmax(-1) == want[:, -1].argmax(-1)).all()


PARAMS = [
    GenerationParams(max_new_tokens=9, temperature=0.0, ignore_eos=True, stream=False),
    GenerationParams(max_new_tokens=3, temperature=0.0, ignore_eos=True, stream=False),
    GenerationParams(max_new_tokens=7, temperature=0.8, top_k=5, seed=9, ignore_eos=True, stream=False),
    GenerationParams(max_new_tokens=5, temperature=0.0, repetition_penalty=1.3, ignore_eos=True, stream=False),
]


def _seqs() -> list[GenSequence]:
    return [GenSequence(request_id=str(i), prompt=[5 + i, 17, 9 + 2 * i, 30, 3 * i + 4], eos_ids=frozenset(),
                        params=params) for i, params in enumerate(PARAMS)]


def _tokens(loop: GenerationLoop, seqs: list[GenSequence]) -> list[list[int]]:
    loop.step(seqs[:2])
    loop.step(seqs[2:])  # joiners beside running rows, rows leaving at different steps
    while loop.has_work():
        loop.step([])
    return [s.future.result(timeout=60).token_ids for s in seqs]


@pytest.mark.parametrize("kind", KINDS)
def test_both_kv_caches_generate_from_an_fp16_model(models: dict[str, Path], kind: str) -> None:
    path = models[f"{kind}-fp16"]
    concat = make_loop(path, prefix_cache_bytes=0, kv_cache="concat")
    in_place = make_loop(path, prefix_cache_bytes=0, kv_cache="in_place")
    assert in_place.kv.in_place and not concat.kv.in_place
    expected = _tokens(concat, _seqs())
    assert _tokens(in_place, _seqs()) == expected
    assert [len(t) for t in expected] == [p.max_new_tokens for p in PARAMS]
    fp32 = make_loop(models[f"{kind}-fp32"], prefix_cache_bytes=0, kv_cache="in_place")
    slots, slots32 = in_place.kv.cache, fp32.kv.cache  # type: ignore[attr-defined]
    assert slots.dtype == np.float16 and slots.nbytes * 2 == slots32.nbytes
    assert in_place.decoder.probe_error is not None and in_place.decoder.probe_error < 1e-2  # type: ignore[attr-defined]


@pytest.mark.parametrize("kv_cache", ["in_place", "concat"])
def test_prefix_reuse_on_an_fp16_cache_gives_the_same_tokens(models: dict[str, Path], kv_cache: str) -> None:
    path = models["llama-fp16"]
    talk = Conversations(count=4, turns=3, vocab=load_card(path).vocab_size)
    plain = make_loop(path, prefix_cache_bytes=0, kv_cache=kv_cache)  # type: ignore[arg-type]
    reusing = make_loop(path, prefix_cache_bytes=64 << 20, kv_cache=kv_cache)  # type: ignore[arg-type]
    assert run_turns(reusing, talk) == run_turns(plain, talk)
    cache = reusing.prefix_cache
    assert cache is not None and cache.hits == talk.count * (talk.turns - 1)
    held = [array for entry in cache._entries.values() for array in entry.kv.values()]
    assert held and {a.dtype for a in held} == {np.dtype(np.float16)}  # kept as the cache holds it, not widened


class _Arg:
    def __init__(self, name: str, type_: str) -> None:
        self.name, self.type = name, type_


def test_a_cache_type_the_fleet_cannot_hold_is_refused_by_name() -> None:
    assert kv_dtype([]) is np.float32
    assert kv_dtype([_Arg("past_key_values.0.key", "tensor(float16)")]) is np.float16
    with pytest.raises(ModelLoadError, match=r"past_key_values\.1\.value is tensor\(bfloat16\).*float32 or float16"):
        kv_dtype([_Arg("past_key_values.0.key", "tensor(float)"), _Arg("past_key_values.1.value", "tensor(bfloat16)")])
    with pytest.raises(ModelLoadError, match="mix tensor"):
        kv_dtype([_Arg("past_key_values.0.key", "tensor(float)"), _Arg("past_key_values.0.value", "tensor(float16)")])


def test_a_worker_serves_an_fp16_model(fleet: Fleet, models: dict[str, Path]) -> None:
    """A real ``celery worker`` on the float16 file: scoring and generation give what the in-process loop gives."""
    path = models["llama-fp16"]
    cfg = fleet.config(worker={"model": "demo-llama"}, models={"demo-llama": {"path": str(path)}})
    worker = fleet.worker(cfg, model="demo-llama", concurrency=8)
    client = fleet.client(cfg)
    scored = client.result(client.submit("demo-llama", [5, 17, 9, 30], top_k=3), wait=True, timeout_s=120)
    assert scored is not None and scored.version == "1.0.0-fp16"
    want = _engine(path, warmup=False).run(pad_batch([[5, 17, 9, 30]], 0))[0, -1]
    assert scored.top_k is not None and scored.top_k[0].token_id == int(want.argmax())
    params = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    generated = client.result(client.submit("demo-llama", [5, 17, 9, 30], generation=params), wait=True,
                              timeout_s=120)
    assert generated is not None and generated.generation is not None
    seq = GenSequence(request_id="x", prompt=[5, 17, 9, 30], eos_ids=frozenset(),
                      params=GenerationParams(**params, stream=False))
    assert generated.generation.token_ids == _tokens(make_loop(path, prefix_cache_bytes=0), [seq])[0]
    assert "KV cache in place (GroupQueryAttention slots of float16 in host memory" in worker.log_path.read_text()


def test_a_worker_serves_an_fp16_encoder_with_the_fp32_ones_vectors(fleet: Fleet, tmp_path: Path) -> None:
    """An encoder converted by ``fleet quantize --target cuda``, served beside its FP32 file: each embedding
    points where the FP32 one does."""
    from tools.build_encoder import build_encoder

    fp32 = build_encoder(tmp_path / "models")
    fp16 = quantize_model(fp32, FP16, progress=False).path
    assert fp16 is not None
    same = {"batching": {"max_batch_size": 8}, "limits": {"max_input_tokens": 64}, "engine": {"intra_op_threads": 1}}
    cfg = fleet.config(models={"enc32": {"path": str(fp32), **same}, "enc16": {"path": str(fp16), **same}})
    for model in ("enc32", "enc16"):
        fleet.worker(cfg, model=model, concurrency=8)
    client = fleet.client(cfg)
    texts = ["the queue is the fleet", "half precision", "ok"]
    vectors = {}
    for model in ("enc32", "enc16"):
        ids = [client.submit(model, text=t, kind="embedding") for t in texts]
        results = [client.result(rid, wait=True, timeout_s=120) for rid in ids]
        assert all(r is not None and r.embedding for r in results)
        vectors[model] = np.asarray([r.embedding for r in results if r is not None], dtype=np.float64)
    assert vectors["enc16"].shape == vectors["enc32"].shape
    cosine = np.sum(vectors["enc16"] * vectors["enc32"], axis=1)  # both L2-normalised
    assert (cosine > 0.999).all(), cosine
