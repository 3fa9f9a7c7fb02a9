"""``fleet bench --provider``: one provider chain for every phase, checked before anything runs, and a
limit that runs the graph the workers serve. (tests/gpu_wheel shows the reasons with the GPU wheel.)"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnxruntime as ort
import psutil
import pytest

from bench.generation import _configs as generation_configs
from bench.genlimit import load_engine
from bench.limit import bare_session
from bench.plan import GenPlan, quick_plan
from bench.procs import FleetConfig
from bench.rounds import start_fleet_servers
from bench.runner import _configs, tensorrt_row_status
from protocol.errors import ProviderUnavailable
from protocol.modelcard import load_card
from protocol.settings import BatchingSettings, EngineSettings, LimitSettings
from tests.integration.fleet_fixtures import Fleet
from workers.engine import Engine
from workers.padding import pad_batch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def demo_lm(model_dir: Path) -> Path:
    """The demo LM built for this test session (tests/conftest.py), not a checkout's models/ folder."""
    return model_dir / "demo-lm" / "demo-lm-1.0.0.onnx"


CUDA_MISSING = "CUDAExecutionProvider is not in this onnxruntime build"


@pytest.mark.parametrize(("flag", "env", "expected"), [
    (["--provider", "cuda"], {}, f"fleet bench: --provider cuda cannot run on this machine: {CUDA_MISSING}"),
    ([], {"FLEET_BENCH_PROVIDER": "cuda"}, f"fleet bench: --provider cuda cannot run on this machine: {CUDA_MISSING}"),
    ([], {"FLEET_BENCH_PROVIDER": "rocm"}, "fleet bench: FLEET_BENCH_PROVIDER='rocm' is not one of ['cpu', 'cuda', "
                                           "'tensorrt']"),
])  # fmt: skip
def test_a_provider_that_cannot_run_here_stops_with_the_reason_before_building_anything(
        tmp_path: Path, flag: list[str], env: dict[str, str], expected: str) -> None:  # fmt: skip
    work = tmp_path / "work"
    cmd = [sys.executable, "-m", "producer.cli", "bench", "--quick", *flag, "--work-dir", str(work),
           "--out", str(tmp_path / "b.md")]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, check=False,
                          env={**os.environ, **env})  # fmt: skip
    assert done.returncode == 2 and expected in done.stderr, done.stderr[-3000:]
    if "cannot run" in expected:  # the reason names the build actually imported
        assert f"(onnxruntime {ort.__version__} from {Path(ort.__file__).parent}" in done.stderr
    assert not work.exists() and not (tmp_path / "b.md").exists()


def test_every_fleet_row_gets_the_chosen_chain_and_refuses_a_silent_cpu_fallback(tmp_path: Path, demo_lm: Path) -> None:
    models = {"fp32": str(demo_lm), "int8": str(demo_lm)}
    for provider, chain in (("cpu", ("CPUExecutionProvider",)),
                            ("cuda", ("CUDAExecutionProvider", "CPUExecutionProvider"))):  # fmt: skip
        configs = _configs(replace(quick_plan(), provider=provider), "demo-lm", models, tmp_path)
        assert set(configs) == {"baseline", "batching", "int8"}  # no TensorRT row on this machine
        for cfg in configs.values():
            engine = cfg.yaml_doc("redis://x")["models"][cfg.model_name]["engine"]
            assert tuple(engine["providers"]) == chain
            assert engine.get("require_provider") == (None if provider == "cpu" else chain[0])


def test_the_tensorrt_row_states_the_real_reason() -> None:
    status = tensorrt_row_status(quick_plan())["status"]
    assert status == ("not run: TensorrtExecutionProvider is not in this onnxruntime build (onnxruntime "
                      f"{ort.__version__} from {Path(ort.__file__).parent}, providers {ort.get_available_providers()})")
    assert tensorrt_row_status(replace(quick_plan(), provider="tensorrt")) == {
        "status": "every row runs TensorRT (--provider tensorrt)"}


def test_the_limit_runs_the_graph_the_workers_serve(demo_lm: Path) -> None:
    """The worker serves the LM head at the last position (lm_head_last, the default): so does the
    limit's bare session, with the same logits for the same batch."""
    card = load_card(demo_lm)
    engine = Engine(demo_lm, card, EngineSettings(), BatchingSettings(), LimitSettings())
    assert engine.lm_head_last
    batch = pad_batch([[5, 6, 7, 8], [9, 10]], card.pad_token_id)
    served = engine.run(batch)
    sess = bare_session(demo_lm)
    assert sess.get_providers() == engine.providers == ["CPUExecutionProvider"]
    (bare,) = sess.run(["logits"], engine.feeds(batch))
    assert served.shape == bare.shape == (2, 1, card.vocab_size)
    np.testing.assert_allclose(bare, served, rtol=1e-5, atol=1e-5)


def test_the_generation_phase_runs_the_chosen_chain_or_refuses(tmp_path: Path, demo_lm: Path) -> None:
    """The generation rows' workers and the in-process generation limit get the chain too; on this CPU
    machine the CUDA chain refuses to measure CPU under a CUDA label."""
    cuda = ("CUDAExecutionProvider", "CPUExecutionProvider")
    for cfg in generation_configs(GenPlan(), "demo-lm", demo_lm, 2.0, cuda).values():
        engine = cfg.yaml_doc("redis://x")["models"][cfg.model_name]["engine"]
        assert tuple(engine["providers"]) == cuda and engine["require_provider"] == "CUDAExecutionProvider"
    card = load_card(demo_lm)
    assert load_engine(demo_lm, card, 4).providers == ["CPUExecutionProvider"]
    with pytest.raises(ProviderUnavailable, match="require_provider=CUDAExecutionProvider"):
        load_engine(demo_lm, card, 4, cuda)


def test_a_worker_that_cannot_start_leaves_no_worker_running(fleet: Fleet, tmp_path: Path, demo_lm: Path) -> None:
    """The bench starts its workers together; one that refuses to start (here: require_provider CUDA on
    a CPU machine) raises with its reason and every worker of that call is stopped, so an optional row
    (TensorRT) that fails is a row status, not a process left behind."""

    good = FleetConfig(label="good", model_name="demo-lm-good", model_path=demo_lm, celery_loglevel="WARNING")
    bad = replace(good, label="bad", model_name="demo-lm-bad",
                  engine_extra={"require_provider": "CUDAExecutionProvider"})  # fmt: skip
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(RuntimeError, match="require_provider=CUDAExecutionProvider"):
        start_fleet_servers({"bad": bad, "good": good}, fleet.redis_url, tmp_path)
    left = [p for p in psutil.Process().children(recursive=True)
            if p.pid not in before and p.is_running() and p.status() != psutil.STATUS_ZOMBIE]  # fmt: skip
    assert left == [], [p.cmdline() for p in left]
