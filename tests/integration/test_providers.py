"""Execution providers: the active ones are logged, and require_provider fails loudly."""

from __future__ import annotations

import pytest

from tests.integration.fleet_fixtures import Fleet


def test_require_cuda_on_a_cpu_machine_stops_the_worker(fleet: Fleet) -> None:
    cfg = fleet.config(models={"demo-lm": {"engine": {"require_provider": "CUDAExecutionProvider"}}})
    worker = fleet.worker(cfg, wait=False)
    assert worker.proc is not None
    code = worker.proc.wait(120)
    log = worker.log_tail(20000)
    assert code != 0
    assert "require_provider=CUDAExecutionProvider" in log
    assert "['CPUExecutionProvider']" in log  # what it actually got


def test_unknown_provider_name_is_a_config_error(fleet: Fleet) -> None:
    from protocol.errors import ConfigError
    from protocol.settings import load_settings

    cfg = fleet.config(models={"demo-lm": {"engine": {"providers": ["CudaProvider"]}}})
    with pytest.raises(ConfigError, match=r"models\.demo-lm\.engine\.providers .*unknown execution provider 'Cuda"):
        load_settings(cfg)  # the field, not the section (was "models.demo-lm.engine")
    cfg = fleet.config(models={"demo-lm": {"engine": {"require_provider": "Cuda"}}})
    with pytest.raises(ConfigError, match=r"models\.demo-lm\.engine\.require_provider .*provider 'Cuda'"):
        load_settings(cfg)
    cfg = fleet.config(models={"demo-lm": {"engine": {"providers": []}}})
    with pytest.raises(ConfigError, match=r"models\.demo-lm\.engine\.providers .*at least one"):
        load_settings(cfg)


def test_concurrency_below_batch_size_stops_the_worker(fleet: Fleet) -> None:
    cfg = fleet.config(models={"demo-lm": {"batching": {"max_batch_size": 16}}}, worker={"concurrency": 16})
    worker = fleet.worker(cfg, concurrency=4, wait=False)
    assert worker.proc is not None
    assert worker.proc.wait(120) != 0
    assert "concurrency" in worker.log_tail(20000) and "max_batch_size" in worker.log_tail(20000)
