"""Opening the ONNX Runtime session one step of the provider chain at a time, and naming the build.

ONNX Runtime's own fallback, when a session cannot be created with the requested providers (the
TensorRT EP whose libraries do not load raises), retries with ``CUDAExecutionProvider`` +
``CPUExecutionProvider`` and *no provider options*: the configured CUDA options vanish without a
word. So the fleet turns that fallback off and walks the chain itself::

    step 1: [TensorRT(opts), CUDA(opts), CPU]   raises -> reason recorded, next step
    step 2: [CUDA(opts), CPU]                   a provider ORT skips (its library did not load)
                                                is recorded with the loader's own error
    step 3: [CPU]

Every provider keeps its configured options at every step, and each step's outcome is returned
(and logged by the engine) with the options the session really applied
(``InferenceSession.get_provider_options()``).
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import onnxruntime as ort

from protocol.errors import ConfigError

__all__ = ["ProviderStep", "imported_ort_build", "open_session", "preload_gpu_libraries", "provider_library_error"]

log = logging.getLogger("fleet.engine")

CPU = "CPUExecutionProvider"

_PROVIDER_LIBRARIES = {
    "TensorrtExecutionProvider": "libonnxruntime_providers_tensorrt.so",
    "CUDAExecutionProvider": "libonnxruntime_providers_cuda.so",
}
"""The shared library each GPU execution provider lives in, inside ``onnxruntime/capi/``."""


@dataclass(frozen=True)
class ProviderStep:
    """What became of one provider of the chain.

    ``requested`` is the options the fleet passed (as configured); ``applied`` is what the session
    reports for an active provider (ONNX Runtime's full option map, values as strings), None when the
    provider is not active; ``reason`` says why it is not.
    """

    provider: str
    requested: dict[str, Any]
    applied: dict[str, str] | None = None
    reason: str | None = None

    @property
    def active(self) -> bool:
        """True when the session runs this provider."""
        return self.applied is not None


_preload_lock = threading.Lock()
_preload_outcome: str | None = None


def preload_gpu_libraries() -> str:
    """Load the CUDA and cuDNN libraries of pip's ``nvidia`` packages once per process; what happened.

    onnxruntime-gpu links ``libcublas.so.13`` & co. but does not find the copies pip installs into the
    same environment (``nvidia/cu13/lib``, ``nvidia/cudnn/lib``) unless they are on the loader's path;
    its ``preload_dlls()`` loads them from there by full path, after which the CUDA provider's library
    resolves them. Called before the first session of a GPU chain, so ``pip install
    "onnxruntime-gpu[cuda,cudnn]" nvidia-cublas`` works without ``LD_LIBRARY_PATH``. ``preload_dlls``
    prints what it could not load: that text is returned (and logged) instead of reaching stdout.
    A build without ``preload_dlls`` (older than 1.21) or without CUDA does nothing.
    """
    global _preload_outcome
    with _preload_lock:
        if _preload_outcome is None:
            preload = getattr(ort, "preload_dlls", None)
            if preload is None:
                _preload_outcome = "not attempted: this onnxruntime has no preload_dlls (older than 1.21)"
            else:
                printed = io.StringIO()
                try:
                    with contextlib.redirect_stdout(printed):
                        preload()
                    text = " ".join(printed.getvalue().split())
                    _preload_outcome = f"preload_dlls: {text}" if text else "preload_dlls: loaded"
                except Exception as exc:  # a broken nvidia package must not stop the CPU step of the chain
                    _preload_outcome = f"preload_dlls failed: {_first_line(exc)}"
            log.info("CUDA libraries from pip's nvidia packages: %s", _preload_outcome)
        return _preload_outcome


def provider_library_error(provider: str) -> str | None:
    """Why ``provider``'s shared library cannot load here (the dynamic loader's message), else None.

    Loads ``onnxruntime/capi/libonnxruntime_providers_<x>.so`` of the *imported* build the way ONNX
    Runtime does; a missing TensorRT or CUDA user-space library shows up as e.g. ``libnvinfer.so.10:
    cannot open shared object file``. CPU, and providers the build does not ship as a library, give None.
    """
    library = _PROVIDER_LIBRARIES.get(provider)
    if library is None:
        return None
    path = os.path.join(os.path.dirname(ort.__file__), "capi", library)
    if not os.path.exists(path):
        return f"{library} is not part of this onnxruntime build ({os.path.dirname(ort.__file__)})"
    try:
        ctypes.CDLL(path, mode=os.RTLD_LAZY | os.RTLD_LOCAL)
    except OSError as exc:
        return str(exc)
    return None


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:400] or type(exc).__name__


def open_session(
    source: str | bytes,
    make_options: Callable[[], ort.SessionOptions],
    chain: list[tuple[str, dict[str, Any]]],
) -> tuple[ort.InferenceSession, list[ProviderStep]]:
    """A session from the first step of ``chain`` that ONNX Runtime can create, and every step's outcome.

    Step k asks for ``chain[k:]`` (each provider with its own options), with ONNX Runtime's
    option-dropping fallback disabled. A step that raises records its first provider's reason and
    moves on; a step that opens is kept, and each provider of it that is not active is recorded with
    the loader's reason. CPU is the last step whether or not the chain names it.

    Raises:
        Exception: ONNX Runtime's error when even the CPU step fails (a broken model file).
    """
    steps: list[ProviderStep] = []
    last = chain if chain and chain[-1][0] == CPU else [*chain, (CPU, {})]
    if any(name in _PROVIDER_LIBRARIES and name in ort.get_available_providers() for name, _ in last):
        preload_gpu_libraries()
    for k in range(len(last)):
        attempt = last[k:]
        name, options = attempt[0]
        try:
            session = ort.InferenceSession(
                source,
                sess_options=make_options(),
                providers=[n for n, _ in attempt],
                provider_options=[dict(o) for _, o in attempt],
                enable_fallback=0,
            )
        except Exception as exc:  # ORT raises RuntimeError / its own Fail and InvalidGraph types
            if name == CPU:
                raise
            loader = provider_library_error(name)
            reason = _first_line(exc) + (f" (library: {loader})" if loader else "")
            steps.append(ProviderStep(name, dict(options), reason=reason))
            log.warning("execution provider %s with options %s could not open the session: %s; trying %s",
                        name, options, reason, [n for n, _ in last[k + 1:]])
            continue
        active = session.get_providers()
        applied = session.get_provider_options()
        for step_name, step_options in attempt:
            if step_name in active:
                steps.append(ProviderStep(step_name, dict(step_options), applied=dict(applied.get(step_name, {}))))
                continue
            loader = provider_library_error(step_name)
            reason = f"onnxruntime did not create it: {loader}" if loader else (
                "onnxruntime did not create it (no device, or see its log above)")
            steps.append(ProviderStep(step_name, dict(step_options), reason=reason))
        return session, steps
    raise AssertionError("unreachable: the CPU step either returns or raises")


def imported_ort_build() -> str:
    """The ONNX Runtime build this process actually imported: package, version, folder, providers.

    Read from the imported module's own files (``onnxruntime/capi/build_and_package_info.py``,
    written into each wheel at build time) and from its native library, not from the installed
    distributions' metadata: with ``onnxruntime-gpu`` installed over an image's ``onnxruntime`` both
    metadata folders exist while one set of files is imported. Both metadata present is logged as a
    warning (uninstalling either would delete files the other needs); a native library whose version
    differs from the Python files is a real mix of two builds and is refused.

    Raises:
        ConfigError: the Python files and the native library of ``onnxruntime`` come from different builds.
    """
    from importlib.metadata import PackageNotFoundError, version

    from onnxruntime.capi import _pybind_state

    try:
        from onnxruntime.capi import build_and_package_info as info

        package = str(getattr(info, "package_name", "onnxruntime"))
    except ImportError:  # builds from source without the file
        package = "onnxruntime"
    native = str(_pybind_state.get_version_string())
    folder = os.path.dirname(ort.__file__)
    where = f"{package} {ort.__version__} from {folder}, providers {ort.get_available_providers()}"
    if native != ort.__version__:
        raise ConfigError(
            f"the imported onnxruntime is a mix of two builds: Python files {package} {ort.__version__}, native "
            f"library {native} ({folder}); pip uninstall -y onnxruntime onnxruntime-gpu, then reinstall exactly "
            "one (`pip install -e .` for the CPU build, `FLEET_ORT=gpu pip install -e .` for the GPU build)",
            "onnxruntime",
            "one build",
        )
    metadata = {}
    for dist in ("onnxruntime", "onnxruntime-gpu"):
        try:
            metadata[dist] = version(dist)
        except PackageNotFoundError:
            continue
    others = {d: v for d, v in metadata.items() if d != package}
    if others:
        log.warning("onnxruntime: running %s; the metadata of %s is installed too (they share one module "
                    "folder: uninstalling either deletes files of the other)", where, others)
    return where
