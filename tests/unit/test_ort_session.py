"""The provider chain walked one step at a time (workers.ort_session.open_session), on the CPU build.

The TensorRT step's failure is simulated here (this build has no TensorRT); tests/gpu_wheel shows
the same walk with the real onnxruntime-gpu wheel, whose TensorRT and CUDA libraries do not load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnxruntime as ort
import pytest

from workers import ort_session
from workers.ort_session import open_session

TRT = ("TensorrtExecutionProvider", {"trt_fp16_enable": True, "trt_max_workspace_size": 1 << 30})
CUDA = ("CUDAExecutionProvider", {"device_id": 1, "arena_extend_strategy": "kSameAsRequested"})
CPU: tuple[str, dict[str, Any]] = ("CPUExecutionProvider", {})


REAL_SESSION = ort.InferenceSession
Call = tuple[list[str], list[dict[str, Any]], int]


class Recorder:
    """Records each step's providers and options; TensorRT first raises as the real EP does when its
    libraries do not load; otherwise a real CPU session over the providers this build has."""

    def __init__(self) -> None:
        self.calls: list[Call] = []

    def __call__(self, source: str | bytes, **kwargs: Any) -> ort.InferenceSession:
        providers, options = kwargs["providers"], kwargs["provider_options"]
        self.calls.append((list(providers), [dict(o) for o in options], kwargs["enable_fallback"]))
        if providers[0] == "TensorrtExecutionProvider":
            raise RuntimeError("Please install TensorRT libraries as mentioned in the GPU requirements page")
        have = ort.get_available_providers()
        kept = [(p, o) for p, o in zip(providers, options, strict=True) if p in have]
        return REAL_SESSION(source, sess_options=kwargs["sess_options"], providers=[p for p, _ in kept],
                            provider_options=[o for _, o in kept], enable_fallback=0)


@pytest.fixture
def model(model_dir: Path) -> str:
    """The demo LM built for this test session (tests/conftest.py), not a checkout's models/ folder."""
    return str(model_dir / "demo-lm" / "demo-lm-1.0.0.onnx")


@pytest.fixture
def recording(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    recorder = Recorder()
    monkeypatch.setattr(ort, "InferenceSession", recorder)
    return recorder


def test_every_step_passes_each_provider_its_configured_options(model: str, recording: Recorder) -> None:
    session, steps = open_session(model, ort.SessionOptions, [TRT, CUDA, CPU])
    assert recording.calls == [
        (["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"], [TRT[1], CUDA[1], {}], 0),
        (["CUDAExecutionProvider", "CPUExecutionProvider"], [CUDA[1], {}], 0),
    ]
    assert session.get_providers() == ["CPUExecutionProvider"]
    assert [(s.provider, s.requested, s.active) for s in steps] == [
        (TRT[0], TRT[1], False), (CUDA[0], CUDA[1], False), (CPU[0], {}, True)]
    assert steps[0].reason is not None and "TensorRT libraries" in steps[0].reason
    # the CUDA step opened a session, but CUDA is not in it: the loader's reason is recorded
    assert steps[1].reason == ("onnxruntime did not create it: libonnxruntime_providers_cuda.so is not part of "
                               f"this onnxruntime build ({Path(ort.__file__).parent})")
    assert steps[2].applied == session.get_provider_options()["CPUExecutionProvider"]


def test_a_chain_without_cpu_ends_on_cpu(model: str, recording: Recorder) -> None:
    session, steps = open_session(model, ort.SessionOptions, [TRT])
    assert [c[0] for c in recording.calls] == [
        ["TensorrtExecutionProvider", "CPUExecutionProvider"], ["CPUExecutionProvider"]]
    assert session.get_providers() == ["CPUExecutionProvider"]
    assert [s.provider for s in steps] == ["TensorrtExecutionProvider", "CPUExecutionProvider"]


def test_a_model_that_cpu_cannot_open_raises_onnxruntimes_error() -> None:
    with pytest.raises(Exception, match=r"(?i)protobuf|parse|invalid"):
        open_session(b"not an onnx model", ort.SessionOptions, [CPU])


def test_the_cpu_build_ships_no_gpu_provider_library() -> None:
    folder = Path(ort.__file__).parent
    assert ort_session.provider_library_error("CPUExecutionProvider") is None
    assert ort_session.provider_library_error("TensorrtExecutionProvider") == (
        f"libonnxruntime_providers_tensorrt.so is not part of this onnxruntime build ({folder})")
