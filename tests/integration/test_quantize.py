"""``fleet quantize`` on the real demo model: dynamic and static INT8, reports, and the accuracy gate."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from producer.cli import main as fleet_main
from protocol.modelcard import load_card
from tools.build_encoder import build_encoder
from tools.build_lm import build_causal_lm
from tools.calibration import feeds_for, input_names, synthetic_sequences, write_sequences


@pytest.fixture(scope="module")
def demo_lm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private copy of the demo LM (quantized files are written next to it)."""
    return build_causal_lm(tmp_path_factory.mktemp("quant-models"))


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any] | None, str]:
    """(exit code, the JSON report printed on stdout or None, stderr)."""
    code = fleet_main(["quantize", *argv, "--quiet"])
    out, err = capsys.readouterr()
    lines = [line for line in out.splitlines() if line.startswith("{")]
    return code, (json.loads(lines[-1]) if lines else None), err


def _check_written(report: dict[str, Any], expected: Path, version: str, label: str) -> None:
    assert report["written"] is True and report["gate"]["passed"] is True
    assert Path(report["output"]) == expected and expected.exists()
    card = load_card(expected)
    assert (card.version, card.quantization, card.name) == (version, label, "demo-lm")
    on_disk = json.loads(expected.with_name(expected.stem + ".report.json").read_text())
    assert on_disk["sizes"] == report["sizes"]
    assert report["sizes"]["int8_bytes"] == expected.stat().st_size
    assert 0 < report["sizes"]["ratio"] < 0.35
    acc = report["accuracy"]
    assert acc["prompts"] == 64 and 0.8 <= acc["top1_agreement"] <= 1.0
    assert 0 <= acc["mean_kl"] < 0.05 and acc["max_abs_delta_logprob"] >= acc["max_abs_delta_logprob_top5"] >= 0
    assert report["latency"]["fp32_ms"] > 0 and report["latency"]["int8_ms"] > 0
    meta = {p.key: p.value for p in onnx.load(str(expected), load_external_data=False).metadata_props}
    assert meta["version"] == version and meta["quantization"] == label
    # The new file serves: same I/O as FP32, finite logits.
    sess = ort.InferenceSession(str(expected), providers=["CPUExecutionProvider"])
    (logits,) = sess.run(["logits"], feeds_for(input_names(expected), card, [[5, 6, 7, 8]]))
    assert logits.shape == (1, 4, card.vocab_size) and np.isfinite(logits).all()


def test_dynamic_int8_written_with_report(demo_lm: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, report, err = _run(capsys, str(demo_lm), "--mode", "dynamic")
    assert code == 0, err
    assert report is not None
    _check_written(report, demo_lm.with_name("demo-lm-1.0.0-int8.onnx"), "1.0.0-int8", "int8-dynamic")
    assert "wrote" in err


def test_static_qdq_int8_with_calibration_file(
    demo_lm: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    calib = write_sequences(
        tmp_path / "calib.jsonl", synthetic_sequences(24, vocab_size=512, min_tokens=8, max_tokens=64, seed=7)
    )
    code, report, err = _run(capsys, str(demo_lm), "--mode", "static", "--calibration", str(calib))
    assert code == 0, err
    assert report is not None
    _check_written(report, demo_lm.with_name("demo-lm-1.0.0-int8-static.onnx"), "1.0.0-int8-static", "int8-static-qdq")
    assert report["calibration"]["source"] == str(calib) and report["calibration"]["sequences"] == 24


def test_static_symmetric_for_tensorrt(demo_lm: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, report, err = _run(capsys, str(demo_lm), "--mode", "static", "--symmetric", "--calibration-count", "16")
    assert code == 0, err
    assert report is not None and report["symmetric"] is True
    target = demo_lm.with_name("demo-lm-1.0.0-int8-static-sym.onnx")
    _check_written(report, target, "1.0.0-int8-static-sym", "int8-static-qdq-symmetric")
    graph = onnx.load(str(target)).graph
    zero_points = {i.name: i for i in graph.initializer if i.name.endswith("zero_point")}
    assert zero_points, "a QDQ model has zero points"
    assert all(onnx.numpy_helper.to_array(z).dtype == np.int8 for z in zero_points.values())
    assert all(not onnx.numpy_helper.to_array(z).any() for z in zero_points.values())  # symmetric: all 0


def test_gate_refuses_above_what_it_measured(demo_lm: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, first, _ = _run(capsys, str(demo_lm), "--mode", "dynamic", "--version", "1.0.0-int8-probe")
    assert code == 0 and first is not None
    measured_top1 = first["accuracy"]["top1_agreement"]
    measured_kl = first["accuracy"]["mean_kl"]

    target = demo_lm.with_name("demo-lm-1.0.0-int8-gated.onnx")
    code, report, err = _run(
        capsys, str(demo_lm), "--version", "1.0.0-int8-gated", "--min-top1-agreement", str(measured_top1 + 0.01)
    )
    assert code == 1
    assert not target.exists() and not target.with_suffix(".json").exists()
    assert report is not None and report["written"] is False and report["gate"]["passed"] is False
    assert "refused" in err and f"top-1 agreement {measured_top1:.3f}" in err and "mean KL" in err

    code, report, err = _run(capsys, str(demo_lm), "--version", "1.0.0-int8-gated", "--max-kl", str(measured_kl / 2))
    assert code == 1 and not target.exists()
    assert report is not None and any("max_kl" in f for f in report["gate"]["failures"])
    assert not list(demo_lm.parent.glob(".quantize-*")), "temporary files are cleaned up"


def test_refuses_bad_requests(demo_lm: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(capsys, str(demo_lm), "--mode", "dynamic", "--symmetric")[0] == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": [1, 2, 99999]}\n')
    code, _, err = _run(capsys, str(demo_lm), "--mode", "static", "--version", "x-bad", "--calibration", str(bad))
    assert code == 2 and "bad.jsonl:1" in err
    _run(capsys, str(demo_lm), "--version", "1.0.0-int8-twice")
    code, _, err = _run(capsys, str(demo_lm), "--version", "1.0.0-int8-twice")
    assert code == 2 and "--overwrite" in err
    assert _run(capsys, str(demo_lm), "--version", "1.0.0-int8-twice", "--overwrite")[0] == 0


def test_target_tensorrt_quantizes_static_qdq_symmetric(demo_lm: Path, capsys: pytest.CaptureFixture[str]) -> None:
    version = "1.0.0-int8-trt"
    code, report, err = _run(capsys, str(demo_lm), "--target", "tensorrt", "--version", version,
                             "--calibration-count", "16", "--latency-rounds", "1")  # fmt: skip
    assert code == 0, err
    assert report is not None
    assert (report["target"], report["mode"], report["symmetric"]) == ("tensorrt", "static", True)
    target = demo_lm.with_name(f"demo-lm-{version}.onnx")
    _check_written(report, target, version, "int8-static-qdq-symmetric")
    graph = onnx.load(str(target)).graph
    assert {"QuantizeLinear", "DequantizeLinear"} <= {n.op_type for n in graph.node}
    zero_points = [onnx.numpy_helper.to_array(i) for i in graph.initializer if i.name.endswith("zero_point")]
    assert zero_points and all(z.dtype == np.int8 and not z.any() for z in zero_points)  # signed, symmetric


def test_target_cpu_is_the_default_dynamic_int8(demo_lm: Path, capsys: pytest.CaptureFixture[str]) -> None:
    version = "1.0.0-int8-cpu"
    code, report, err = _run(capsys, str(demo_lm), "--target", "cpu", "--version", version, "--latency-rounds", "1")
    assert code == 0, err
    assert report is not None and (report["target"], report["mode"], report["symmetric"]) == ("cpu", "dynamic", False)
    _check_written(report, demo_lm.with_name(f"demo-lm-{version}.onnx"), version, "int8-dynamic")
    ops = {n.op_type for n in onnx.load(str(demo_lm.with_name(f"demo-lm-{version}.onnx"))).graph.node}
    assert "DynamicQuantizeLinear" in ops


@pytest.mark.parametrize("mode", ["dynamic", "static"])
def test_int8_for_target_cuda_is_refused_with_the_reason_and_the_fix(
    demo_lm: Path, capsys: pytest.CaptureFixture[str], mode: str
) -> None:
    before = sorted(demo_lm.parent.iterdir())
    code, report, err = _run(capsys, str(demo_lm), "--target", "cuda", "--mode", mode)
    assert code == 2 and report is None
    [line] = err.strip().splitlines()
    assert line.startswith("fleet quantize: --target cuda: ")
    for words in ("DynamicQuantizeLinear/MatMulInteger", "42x slower than FP32", "serve the FP32 model on CUDA",
                  "--mode fp16", "--target tensorrt"):  # fmt: skip
        assert words in line
    assert sorted(demo_lm.parent.iterdir()) == before  # nothing written


def test_target_cuda_writes_fp16_with_report(demo_lm: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--target cuda`` without ``--mode``: FP16 (what the CUDA provider runs), through the same report and gate."""
    code, report, err = _run(capsys, str(demo_lm), "--target", "cuda", "--overwrite")
    assert code == 0, err
    assert report is not None and (report["target"], report["mode"], report["quantization"]) == ("cuda", "fp16", "fp16")
    expected = demo_lm.with_name("demo-lm-1.0.0-fp16.onnx")
    assert Path(report["output"]) == expected and load_card(expected).quantization == "fp16"
    assert report["sizes"]["fp16_bytes"] == expected.stat().st_size and 0.4 < report["sizes"]["ratio"] < 0.6
    assert report["accuracy"]["top1_agreement"] >= 0.95 and report["latency"]["fp16_ms"] > 0
    assert "int8_bytes" not in report["sizes"] and "int8_ms" not in report["latency"]
    sess = ort.InferenceSession(str(expected), providers=["CPUExecutionProvider"])
    feeds = feeds_for(input_names(expected), load_card(expected), [[5, 6, 7, 8]], kv_dtype=np.float16)
    (logits,) = sess.run(["logits"], feeds)
    assert logits.dtype == np.float32 and np.isfinite(logits).all()


@pytest.mark.parametrize("mode", ["dynamic", "fp16"])
def test_a_file_quantized_already_is_refused_by_its_card(
    demo_lm: Path, capsys: pytest.CaptureFixture[str], mode: str
) -> None:
    """An FP16 file (or an INT8 one) is not quantized again: ONNX Runtime's quantizers failed on it deep inside."""
    code, _report, err = _run(capsys, str(demo_lm), "--target", "cuda", "--overwrite")
    assert code == 0, err
    fp16 = demo_lm.with_name("demo-lm-1.0.0-fp16.onnx")
    before = sorted(demo_lm.parent.iterdir())
    code, report, err = _run(capsys, str(fp16), "--mode", mode)
    assert code == 2 and report is None
    assert "demo-lm-1.0.0-fp16.onnx is fp16 already (its card's quantization): quantize the FP32 file" in err
    assert sorted(demo_lm.parent.iterdir()) == before


def test_an_encoder_converts_to_fp16_with_a_vector_report_and_int8_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    encoder = build_encoder(tmp_path)
    code, report, err = _run(capsys, str(encoder), "--mode", "dynamic")
    assert code == 2 and report is None and "an encoder converts to FP16 (--mode fp16, or --target cuda)" in err
    code, report, err = _run(capsys, str(encoder), "--target", "cuda")
    assert code == 0, err
    assert report is not None and report["quantization"] == "fp16" and report["gate"] == {
        "min_cosine": 0.99, "passed": True, "failures": []}
    acc = report["accuracy"]
    assert acc["prompts"] == 64 and 0.999 <= acc["min_cosine"] <= acc["mean_cosine"] <= 1.0 + 1e-9
    assert 0 < acc["max_abs_delta"] < 1e-2 and report["latency"]["fp16_ms"] > 0
    assert "smallest cosine similarity" in err
    written = encoder.with_name("demo-encoder-1.0.0-fp16.onnx")
    assert Path(report["output"]) == written and load_card(written).kind == "encoder"
    # the highest gate a cosine takes (1.01 is refused as a flag out of range): FP16 is never exact
    code, refused, err = _run(capsys, str(encoder), "--target", "cuda", "--overwrite", "--min-cosine", "1")
    assert code == 1 and refused is not None and refused["written"] is False
    assert "smallest cosine similarity" in err and "< min_cosine 1.0" in err


@pytest.mark.parametrize(("argv", "words"), [
    (["--target", "tensorrt", "--mode", "fp16"], ["engine.trt_fp16", "serve the FP32 file", "--target cuda"]),
    (["--mode", "fp16", "--symmetric"], ["--symmetric applies to static QDQ INT8"]),
    (["--mode", "fp16", "--per-channel"], ["apply to INT8 modes, not to --mode fp16"]),
])  # fmt: skip
def test_fp16_with_what_it_cannot_take_is_refused(
    demo_lm: Path, capsys: pytest.CaptureFixture[str], argv: list[str], words: list[str]
) -> None:
    before = sorted(demo_lm.parent.iterdir())
    code, report, err = _run(capsys, str(demo_lm), *argv)
    assert code == 2 and report is None
    for word in words:
        assert word in err
    assert sorted(demo_lm.parent.iterdir()) == before


def test_target_with_a_conflicting_mode_is_refused(demo_lm: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = sorted(demo_lm.parent.iterdir())
    code, report, err = _run(capsys, str(demo_lm), "--target", "tensorrt", "--mode", "dynamic")
    assert code == 2 and report is None
    assert "--target tensorrt" in err and "--mode dynamic" in err and "--target cpu" in err
    assert sorted(demo_lm.parent.iterdir()) == before
