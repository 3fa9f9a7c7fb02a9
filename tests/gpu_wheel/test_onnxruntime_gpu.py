"""The real onnxruntime-gpu wheel, in its own virtual environment, on this GPU-less machine.

onnxruntime-gpu offers TensorRT and CUDA but cannot load them here; the worker must say so
(requested vs ACTIVE providers plus a FALLBACK warning) and ``require_provider`` must refuse to
start. The environment is built once under ``var/ort-gpu-venv`` (about a minute, 256 MB wheel).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.fleet_fixtures import Fleet
from tests.tier_venv import TIERS, ensure_venv

pytestmark = pytest.mark.gpu_wheel

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpu_python() -> str:
    python = ensure_venv(TIERS["ort-gpu"])  # the documented GPU install (FLEET_ORT=gpu), built once
    probe = subprocess.run(
        [str(python), "-c", "import onnxruntime as o, importlib.metadata as m; "
         "print(m.version('onnxruntime-gpu'), o.get_available_providers())"],
        capture_output=True, text=True, check=True, timeout=120)
    assert "CUDAExecutionProvider" in probe.stdout and "TensorrtExecutionProvider" in probe.stdout
    # exactly one ONNX Runtime build in that environment
    dists = subprocess.run([str(python), "-m", "pip", "list", "--format=freeze"], capture_output=True,
                           text=True, check=True).stdout.lower()
    assert "onnxruntime-gpu==" in dists and "\nonnxruntime==" not in "\n" + dists
    return str(python)


def test_gpu_wheel_falls_back_visibly(fleet: Fleet, gpu_python: str) -> None:
    cfg = fleet.config()
    worker = fleet.worker(cfg, python=gpu_python)
    log = worker.log_tail(50000)
    assert "providers requested ['TensorrtExecutionProvider', 'CUDAExecutionProvider', 'CPUExecutionProvider']" in log
    assert "ACTIVE ['CPUExecutionProvider']" in log
    assert "FALLBACK" in log
    client = fleet.client(cfg)
    result = client.result(client.submit("demo-lm", [5, 6, 7]), wait=True, timeout_s=60)
    assert result is not None and result.top_k


def test_gpu_wheel_require_cuda_refuses_to_start(fleet: Fleet, gpu_python: str) -> None:
    cfg = fleet.config(models={"demo-lm": {"engine": {"require_provider": "CUDAExecutionProvider"}}})
    worker = fleet.worker(cfg, python=gpu_python, wait=False)
    assert worker.proc is not None
    assert worker.proc.wait(300) != 0
    assert "require_provider=CUDAExecutionProvider" in worker.log_tail(50000)


CUDA_OPTIONS = {"arena_extend_strategy": "kSameAsRequested", "cudnn_conv_algo_search": "HEURISTIC"}
TRT_OPTIONS = {"trt_max_workspace_size": 1073741824}


def test_each_step_of_the_chain_keeps_its_configured_options(fleet: Fleet, gpu_python: str) -> None:
    """TensorRT cannot open the session here (its libraries do not load): the worker tries CUDA next
    with CUDA's configured options (ONNX Runtime's own fallback would retry with none), then runs on
    CPU, and logs each step's reason from the dynamic loader."""
    cfg = fleet.config(models={"demo-lm": {"engine": {"provider_options": {
        "TensorrtExecutionProvider": TRT_OPTIONS, "CUDAExecutionProvider": CUDA_OPTIONS}}}})
    worker = fleet.worker(cfg, python=gpu_python)
    log = worker.log_tail(50000)
    print(log[-6000:])
    lines = log.splitlines()
    trt = [ln for ln in lines if "FALLBACK: TensorrtExecutionProvider" in ln]
    cuda = [ln for ln in lines if "FALLBACK: CUDAExecutionProvider" in ln]
    assert len(trt) == 1 and len(cuda) == 1, (trt, cuda)
    assert "'trt_max_workspace_size': 1073741824" in trt[0] and "cannot open shared object file" in trt[0]
    assert f"(options requested {CUDA_OPTIONS})" in cuda[0] and "cannot open shared object file" in cuda[0]
    assert "execution provider CPUExecutionProvider ACTIVE" in log
    # ONNX Runtime's option-dropping retry never ran
    assert "Falling back to" not in log and "EP Error" not in log
    client = fleet.client(cfg)
    result = client.result(client.submit("demo-lm", [5, 6, 7]), wait=True, timeout_s=60)
    assert result is not None and result.top_k


def _build_named_with_both_metadata(python: str, other_site: Path) -> str:
    """``check_single_ort_build()`` in ``python`` with ``other_site`` (holding the other build's
    distribution metadata and files) at the end of ``sys.path``: both builds' metadata are visible,
    one set of files is imported. Prints the module actually imported first."""
    code = ("import sys; sys.path.append(sys.argv[1]); import onnxruntime, workers.engine as e; "
            "print(onnxruntime.__file__); print(e.__file__); print(e.check_single_ort_build())")
    proc = subprocess.run([python, "-c", code, str(other_site)], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    print(proc.stdout)
    return proc.stdout.splitlines()[-1]


def _site_packages(python: str) -> Path:
    out = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    return Path(out)


def test_the_gpu_build_over_a_cpu_image_is_named_and_starts(gpu_python: str) -> None:
    """onnxruntime-gpu imported while the CPU build's metadata is installed too (an image's CPU build
    under it): the worker names the GPU build it imported instead of refusing to start."""
    named = _build_named_with_both_metadata(gpu_python, _site_packages(sys.executable))
    assert named.startswith(f"onnxruntime-gpu 1.31.1 from {_site_packages(gpu_python)}/onnxruntime")
    assert "CUDAExecutionProvider" in named


def test_the_cpu_build_with_gpu_metadata_present_is_named_as_the_cpu_build(gpu_python: str) -> None:
    import onnxruntime

    named = _build_named_with_both_metadata(sys.executable, _site_packages(gpu_python))
    assert named.startswith(f"onnxruntime {onnxruntime.__version__} from {_site_packages(sys.executable)}/onnxruntime")
    assert "CUDAExecutionProvider" not in named


def test_a_module_folder_mixing_both_builds_is_refused(gpu_python: str, tmp_path: Path) -> None:
    """The CPU build's folder with the GPU build's Python files copied over it (what installing one
    build over the other can leave): the native library and the Python files disagree, and the
    worker refuses to start, naming both."""
    import shutil

    import onnxruntime

    mixed = tmp_path / "onnxruntime"
    shutil.copytree(Path(onnxruntime.__file__).parent, mixed)
    gpu_files = _site_packages(gpu_python) / "onnxruntime"
    for source in gpu_files.rglob("*.py"):
        target = mixed / source.relative_to(gpu_files)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
    code = "import onnxruntime, workers.engine as e; print(onnxruntime.__file__); e.check_single_ort_build()"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"})
    assert proc.stdout.startswith(str(mixed)), proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert (f"a mix of two builds: Python files onnxruntime-gpu 1.31.1, native library {onnxruntime.__version__}"
            in proc.stderr), proc.stderr[-3000:]


def test_bench_names_the_libraries_that_do_not_load(gpu_python: str, tmp_path: Path) -> None:
    """onnxruntime-gpu lists TensorRT and CUDA, but their libraries do not load here: ``fleet bench
    --provider`` stops with the loader's reason before building anything, and the TensorRT row of a
    CPU run says the same (not "needs a GPU")."""
    for provider, expected in (("tensorrt", "TensorRT libraries not found (libcublas.so.13: cannot open shared"),
                               ("cuda", "CUDA libraries not found (libcublasLt.so.13: cannot open shared")):
        work = tmp_path / provider
        done = subprocess.run([gpu_python, "-m", "bench.cli", "--quick", "--provider", provider, "--work-dir",
                               str(work), "--out", str(tmp_path / "b.md")],
                              capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
        assert done.returncode == 2, done.stderr[-3000:]
        assert f"--provider {provider} cannot run on this machine: {expected}" in done.stderr, done.stderr[-3000:]
        assert not work.exists()
    code = ("import bench.runner as r; from bench.plan import quick_plan; print(r.__file__); "
            "print(r.tensorrt_row_status(quick_plan())['status'])")
    row = subprocess.run([gpu_python, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert row.stdout.startswith(str(ROOT)), row.stdout + row.stderr
    assert row.stdout.splitlines()[-1].startswith("not run: TensorRT libraries not found (libcublas.so.13")


def test_gpu_report_quotes_the_loader_for_each_gpu_provider(gpu_python: str) -> None:
    """``fleet gpu-report``'s provider table on the real GPU build: TensorRT and CUDA are in the build,
    neither loads here, and each row quotes the dynamic loader's message, not a guess."""
    code = "import json; from bench.gpu_report import provider_rows; print(json.dumps(provider_rows()))"
    done = subprocess.run([gpu_python, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["provider"]: r for r in __import__("json").loads(done.stdout.splitlines()[-1])}
    assert rows["TensorrtExecutionProvider"]["in_build"] and rows["CUDAExecutionProvider"]["in_build"]
    assert not rows["TensorrtExecutionProvider"]["loads"] and not rows["CUDAExecutionProvider"]["loads"]
    assert rows["TensorrtExecutionProvider"]["reason"].startswith("TensorRT libraries not found (libcublas.so.13")
    assert rows["CUDAExecutionProvider"]["reason"].startswith("CUDA libraries not found (libcublasLt.so.13")
    assert rows["CPUExecutionProvider"]["loads"]


def test_pip_cuda_libraries_are_preloaded_once_and_quietly(gpu_python: str) -> None:
    """Before the first session of a GPU chain the worker asks onnxruntime-gpu's ``preload_dlls`` to load
    the CUDA libraries of pip's nvidia packages (none are installed here): what it could not load is
    returned and logged, nothing is printed to stdout, and the chain still falls back to CPU."""
    code = ("import logging, sys; logging.basicConfig(stream=sys.stderr, level=logging.INFO)\n"
            "import onnxruntime as ort\n"
            "from workers.ort_session import open_session, preload_gpu_libraries\n"
            "from bench.machine import _tiny_model\n"
            "_s, steps = open_session(_tiny_model(), ort.SessionOptions, [('CUDAExecutionProvider', {})])\n"
            "print('ACTIVE', [st.provider for st in steps if st.active])\n"
            "print('OUTCOME', preload_gpu_libraries())\n")
    done = subprocess.run([gpu_python, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout.splitlines()
    assert out[0] == "ACTIVE ['CPUExecutionProvider']", done.stdout  # preload_dlls printed nothing of its own
    assert out[1].startswith("OUTCOME preload_dlls: Failed to load libcublasLt.so.13"), out[1]
    assert done.stderr.count("CUDA libraries from pip's nvidia packages:") == 1  # once per process


def test_this_environment_has_only_the_cpu_build() -> None:
    out = subprocess.run([sys.executable, "-m", "pip", "list", "--format=freeze"], capture_output=True,
                         text=True, check=True).stdout.lower()
    assert "onnxruntime==" in out and "onnxruntime-gpu" not in out


def test_gpu_wheel_serves_a_float16_model_in_place_after_the_gpu_steps_fall_back(
        fleet: Fleet, gpu_python: str, tmp_path: Path) -> None:
    """``fleet quantize --target cuda``'s file on the default chain: a float16 graph with CUDA in the chain gets
    the in-place cache; here CUDA cannot load, the session runs on CPU, and the slots stay in host memory."""
    from tools.build_llama import build_llama
    from tools.quantize import quantize_model
    from tools.quantize_config import QuantizeConfig

    fp16 = quantize_model(build_llama(tmp_path / "models"), QuantizeConfig(mode="fp16", target="cuda", eval_count=8,
                          latency_rounds=1, latency_prompts=2), progress=False).path  # fmt: skip
    assert fp16 is not None
    cfg = fleet.config(worker={"model": "demo-llama"}, models={"demo-llama": {"path": str(fp16)}})
    worker = fleet.worker(cfg, model="demo-llama", python=gpu_python)
    log = worker.log_tail(50000)
    assert "ACTIVE ['CPUExecutionProvider']" in log and "FALLBACK" in log
    assert "KV cache in place (GroupQueryAttention slots of float16 in host memory" in log
    client = fleet.client(cfg)
    params = {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    result = client.result(client.submit("demo-llama", [5, 17, 9, 30], generation=params), wait=True, timeout_s=120)
    assert result is not None and result.generation is not None and len(result.generation.token_ids) == 5
    assert result.version == "1.0.0-fp16"


def test_gpu_wheel_asked_for_cuda_graphs_serves_without_them_and_says_why(
        fleet: Fleet, gpu_python: str, tmp_path: Path) -> None:
    """``engine.cuda_graph`` on a CUDA chain: the session asks the CUDA provider for graph capture; here that
    provider cannot load, so the worker reopens the chain as configured, logs why there are no graphs, and
    generates on the in-place cache with steps launched one kernel at a time."""
    from tools.build_llama import build_llama
    from tools.quantize import quantize_model
    from tools.quantize_config import QuantizeConfig

    fp16 = quantize_model(build_llama(tmp_path / "models"), QuantizeConfig(mode="fp16", target="cuda", eval_count=8,
                          latency_rounds=1, latency_prompts=2), progress=False).path  # fmt: skip
    assert fp16 is not None
    engine = {"providers": ["CUDAExecutionProvider", "CPUExecutionProvider"], "cuda_graph": True}
    cfg = fleet.config(worker={"model": "demo-llama"}, models={"demo-llama": {"path": str(fp16), "engine": engine}})
    worker = fleet.worker(cfg, model="demo-llama", python=gpu_python)
    log = worker.log_tail(50000)
    print(log[-6000:])
    why = [ln for ln in log.splitlines() if "engine.cuda_graph is on but decode steps run without CUDA graphs" in ln]
    # the chain with graph capture was tried first; the loader's reason is quoted
    assert len(why) == 1 and "the CUDA provider did not open with graph capture: " in why[0], why
    assert "cannot open shared object file" in why[0]
    assert "ACTIVE ['CPUExecutionProvider']" in log
    assert "decode steps as CUDA graphs: no)" in log
    client = fleet.client(cfg)
    params = {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    result = client.result(client.submit("demo-llama", [5, 17, 9, 30], generation=params), wait=True, timeout_s=120)
    assert result is not None and result.generation is not None and len(result.generation.token_ids) == 5
