"""INT8 models as ``fleet quantize`` writes them, served: the last-position LM head, and the warning
for INT8 on a GPU provider that has no INT8 kernels for them."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from protocol.modelcard import card_path_for, load_card
from protocol.settings import BatchingSettings, EngineSettings, LimitSettings
from tools.build_llama import build_llama
from tools.build_lm import build_causal_lm
from tools.lm_head_last import main as rewrite
from tools.quantize import quantize_model
from tools.quantize_config import QuantizeConfig
from workers.engine import Engine, serving_graph
from workers.int8_providers import graph_op_types, int8_placement_warning, int8_provider_warning
from workers.padding import pad_batch

CONFIGS = {
    "dynamic": QuantizeConfig(mode="dynamic", eval_count=16, latency_rounds=1, latency_prompts=4),
    "static": QuantizeConfig(mode="static", calibration_count=16, eval_count=16, latency_rounds=1, latency_prompts=4),
}
CUDA = ["CUDAExecutionProvider", "CPUExecutionProvider"]
TRT = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
CPU = ["CPUExecutionProvider"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """FP32 demo LMs (GPT- and Llama-style), their dynamic and static QDQ INT8 files, and the
    dynamic one after ONNX Runtime's optimizer (its head fused into ``DynamicQuantizeMatMul``)."""
    root = tmp_path_factory.mktemp("int8-models")
    out: dict[str, Path] = {}
    for kind, build in (("lm", build_causal_lm), ("llama", build_llama)):
        out[f"{kind}-fp32"] = fp32 = build(root)
        for mode, cfg in CONFIGS.items():
            path = quantize_model(fp32, cfg, progress=False).path
            assert path is not None
            out[f"{kind}-{mode}"] = path
    dynamic = out["lm-dynamic"]
    fused = dynamic.with_name(dynamic.stem + "-fused.onnx")
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    opts.optimized_model_filepath = str(fused)
    ort.InferenceSession(str(dynamic), opts, providers=CPU)
    card_path_for(fused).write_text(card_path_for(dynamic).read_text())
    out["lm-dynamic-fused"] = fused
    return out


INT8 = ["lm-dynamic", "lm-static", "llama-dynamic", "llama-static", "lm-dynamic-fused"]


def _engine(path: Path, *, lm_head_last: bool) -> Engine:
    settings = EngineSettings(providers=CPU, warmup=False, lm_head_last=lm_head_last)
    return Engine(path, load_card(path), settings, BatchingSettings(), LimitSettings(max_input_tokens=64))


def _ops(path: Path) -> set[str]:
    return {n.op_type for n in onnx.load(str(path)).graph.node}


def test_the_int8_heads_are_the_forms_onnxruntime_writes(models: dict[str, Path]) -> None:
    assert {"DynamicQuantizeLinear", "MatMulInteger"} <= _ops(models["lm-dynamic"])
    assert {"QuantizeLinear", "DequantizeLinear"} <= _ops(models["lm-static"])
    assert "DynamicQuantizeMatMul" in _ops(models["lm-dynamic-fused"])


@pytest.mark.parametrize("name", INT8)
def test_worker_serves_int8_logits_at_the_last_position_only(models: dict[str, Path], name: str) -> None:
    path = models[name]
    card = load_card(path)
    source, last_only = serving_graph(path, EngineSettings(providers=CPU, lm_head_last=True), card)
    assert last_only and isinstance(source, bytes)  # before: (path, False), logits at every position
    full, last = _engine(path, lm_head_last=False), _engine(path, lm_head_last=True)
    assert last.lm_head_last
    batch = pad_batch([[5, 6, 7], [9] * 20, [300], [4, 4, 4, 4, 4, 4, 4], [17, 260, 33, 2, 9]])
    out_full, out_last = full.run(batch), last.run(batch)
    rows = np.arange(len(batch.lengths))
    assert out_full.shape == (5, 20, card.vocab_size)
    assert out_last.shape == (5, 1, card.vocab_size)
    # the rows of the full INT8 graph at each row's last real token (the INT8 arithmetic is the same)
    np.testing.assert_allclose(out_last[:, 0], out_full[rows, np.asarray(batch.lengths) - 1], rtol=1e-6, atol=1e-6)


def test_int8_last_position_file_from_the_cli(models: dict[str, Path]) -> None:
    path = models["llama-static"]
    assert rewrite([str(path)]) == 0
    written = path.with_name("demo-llama-1.0.0-int8-static-last.onnx")
    assert load_card(written).version == "1.0.0-int8-static-last"
    # the head keeps its Q -> DQ -> MatMul -> Q -> DQ pattern: the gather sits before the QuantizeLinear
    graph = onnx.load(str(written)).graph
    producers = {o: n for n in graph.node for o in n.output}
    chain, name = [], "logits"
    for _ in range(6):
        node = producers[name]
        chain.append(node.op_type)
        name = node.input[0]
    assert chain == ["DequantizeLinear", "QuantizeLinear", "MatMul", "DequantizeLinear", "QuantizeLinear", "Unsqueeze"]


@pytest.mark.parametrize(
    ("name", "providers", "expected"),
    [
        ("lm-dynamic", CUDA, "dynamic INT8 ops DynamicQuantizeLinear/MatMulInteger have no CUDA kernels"),
        ("llama-dynamic", TRT, "dynamic INT8 ops DynamicQuantizeLinear/MatMulInteger have no CUDA kernels"),
        ("lm-dynamic-fused", CUDA, "dynamic INT8 ops DynamicQuantizeMatMul have no CUDA kernels"),
        ("lm-static", CUDA, "static QDQ INT8 gets no INT8 kernels on the CUDA EP without TensorRT"),
        ("lm-static", TRT, None),
        ("lm-dynamic", CPU, None),
        ("lm-static", CPU, None),
        ("lm-fp32", CUDA, None),
        ("llama-fp32", TRT, None),
    ],
)
def test_int8_on_a_gpu_provider_without_int8_kernels_is_named(
    models: dict[str, Path], name: str, providers: list[str], expected: str | None
) -> None:
    warning = int8_provider_warning(graph_op_types(models[name]), providers)
    assert warning == int8_placement_warning(models[name], providers)
    if expected is None:
        assert warning is None
        return
    assert warning is not None and warning.startswith(expected) and "\n" not in warning
    assert "FP32/FP16 on CUDA" in warning
    if "dynamic" in name:
        assert "run on CPU with copies per batch" in warning and "`fleet quantize --target tensorrt`" in warning
    else:
        assert "TensorrtExecutionProvider" in warning


def test_a_cpu_worker_loading_int8_logs_no_gpu_warning(
    models: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="fleet.engine"):
        _engine(models["lm-dynamic"], lm_head_last=True)
    assert not [r for r in caplog.records if "INT8" in r.getMessage()]
