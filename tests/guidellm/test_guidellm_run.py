"""guidellm, the load client vLLM users already run, benchmarks a real gateway and worker unchanged.

guidellm 0.8.1 is installed in ``var/guidellm-venv`` (built once, a few minutes; reused while
its pins stay the same). Its OpenAI backend probes ``GET /health``, lists ``GET /v1/models`` and
streams each request with ``stream_options: {"include_usage": true, "continuous_usage_stats":
true}``, ``max_completion_tokens`` (chat) or ``max_tokens`` (completions), ``stop: null`` and
``ignore_eos: true``. A few requests per route, synchronous then 4 concurrent streams; every request
must succeed with the forced output length, as counted from the gateway's own ``usage``.

Offline, or on a machine without the CPU torch wheel, the tier skips (see ``tests/tier_venv.py``).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.ops_fixtures import API_KEY, GatewayProcess, OpsFleet, ops_models, ops_redis
from tests.tier_venv import TIERS, ensure_venv
from tools.redis_server import EmbeddedRedis

__all__ = ["ops_models", "ops_redis"]

pytestmark = [pytest.mark.guidellm, pytest.mark.timeout(900)]  # the first run builds the venv (a few minutes)

ROOT = Path(__file__).resolve().parents[2]
OUTPUT_TOKENS = 8
REQUESTS = 6


@pytest.fixture(scope="session")
def guidellm_venv() -> Path:
    """The tier's venv (built on first use, reused while its pins stay the same: ``tests.tier_venv``)."""
    ensure_venv(TIERS["guidellm"])
    return TIERS["guidellm"].venv


@pytest.fixture(scope="module")
def tokenizer(guidellm_venv: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("guidellm-tokenizer")
    script = ROOT / "tools" / "guidellm_tokenizer.py"
    proc = subprocess.run([str(guidellm_venv / "bin" / "python"), str(script), str(folder)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, ops_models: Any, ops_redis: EmbeddedRedis
) -> Iterator[GatewayProcess]:
    """A real gateway (API key on) and a demo-lm worker; prompts up to 256 byte tokens."""
    ops = OpsFleet(tmp_path_factory.mktemp("guidellm"), ops_models, ops_redis)
    try:
        config = ops.config(serve=("demo-lm",), models={"demo-lm": {"limits": {"max_input_tokens": 256}}})
        ops.worker(config, "demo-lm")
        yield ops.gateway(config)
    finally:
        ops.close()


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_guidellm_benchmarks_the_gateway(route: str, guidellm_venv: Path, tokenizer: Path, gateway: GatewayProcess,
                                         tmp_path: Path) -> None:  # fmt: skip
    out = tmp_path / "guidellm.json"
    cmd = [
        str(guidellm_venv / "bin" / "guidellm"), "run",
        "--backend", f"kind=openai_http,target={gateway.url},api_key={API_KEY},request_format={route}",
        "--profile", "kind=concurrent,streams=1",
        "--override", "profile.streams", "1,4",
        "--constraint", f"kind=max_requests,count={REQUESTS}",
        "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
        "--data", f"kind=synthetic_text,prompt_tokens=16,output_tokens={OUTPUT_TOKENS}",
        "--output", f"kind=json,path={out}",
        "--disable-progress",
    ]  # fmt: skip
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    report = json.loads(out.read_text())
    assert len(report["benchmarks"]) == 2  # one per stream count
    for bench in report["benchmarks"]:
        metrics = bench["metrics"]
        assert metrics["request_totals"] == {"successful": REQUESTS, "errored": 0, "incomplete": 0, "total": REQUESTS}
        produced = metrics["output_token_count"]["successful"]  # from the gateway's usage chunks
        assert produced["min"] == produced["max"] == OUTPUT_TOKENS  # ignore_eos: the forced length
        assert metrics["time_to_first_token_ms"]["successful"]["count"] == REQUESTS
