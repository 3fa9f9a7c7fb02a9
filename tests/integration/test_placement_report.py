"""Node placement per execution provider, counted at model load (``engine.report_placement``): in a real
worker's heartbeat, in ``fleet status`` and as ``fleet_engine_nodes``; off, the session never profiles."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.limit import bare_parts
from protocol.modelcard import load_card
from protocol.settings import BatchingSettings, EngineSettings, LimitSettings
from tests.integration.ops_fixtures import OpsFleet, ops_fleet, ops_models, ops_redis, scrape, wait_until
from tools.calibration import feeds_for, input_names
from tools.processes import WorkerProcess
from tools.redis_server import free_port
from workers.engine import Engine
from workers.health import list_workers
from workers.placement import profiled_placement

__all__ = ["ops_fleet", "ops_models", "ops_redis"]

CPU = "CPUExecutionProvider"


def _expected_nodes(model: Path) -> dict[str, int]:
    """What :mod:`workers.placement` counts for the graph a worker serves from ``model`` (CPU chain)."""
    source, make_options, chain = bare_parts(model)
    card = load_card(model)
    return profiled_placement(source, make_options, chain, feeds_for(input_names(model), card, [[5, 6, 7, 8]])).nodes


def _heartbeat(fleet: OpsFleet, hostname: str) -> dict[str, Any]:
    beat: dict[str, Any] = wait_until(
        lambda: next((w for w in list_workers(fleet.redis) if w.get("hostname") == hostname and w.get("ready")), None),
        30,
        f"a ready heartbeat from {hostname}",
    )
    return beat


def _log(worker: WorkerProcess) -> str:
    assert worker.log_path is not None
    return worker.log_path.read_text()


def _worker_row(table: str, hostname: str) -> str:
    return next(line for line in table.splitlines() if line.startswith(hostname))


def test_worker_reports_node_placement(ops_fleet: OpsFleet) -> None:
    port = free_port()
    config = ops_fleet.config(serve=("demo-lm",))
    worker = ops_fleet.worker(config, metrics_port=port)
    expected = _expected_nodes(ops_fleet.models.lm)
    [(provider, total)] = expected.items()
    assert provider == CPU and total > 0  # every node on the CPU here

    assert _heartbeat(ops_fleet, worker.hostname)["nodes"] == {CPU: total}

    out = ops_fleet.fleet_cli(config, "status", "--json", module="producer.ops_cli")
    assert out.returncode == 0, out.stderr
    [w] = json.loads(out.stdout)["workers"]
    assert w["nodes"] == {CPU: total}
    table = ops_fleet.fleet_cli(config, "status", module="producer.ops_cli")
    assert table.returncode == 0, table.stderr
    assert "NODES" in table.stdout.splitlines()[1]
    assert f"CPU {total}" in _worker_row(table.stdout, worker.hostname)

    samples = scrape(f"http://127.0.0.1:{port}/metrics")
    nodes = {dict(labels)["provider"]: value for (name, labels), value in samples.items()
             if name == "fleet_engine_nodes"}  # fmt: skip
    assert nodes == {CPU: float(total)}
    key = ("fleet_engine_nodes", (("model", "demo-lm"), ("provider", CPU), ("version", "1.0.0")))
    assert samples[key] == total
    assert f"model demo-lm 1.0.0: nodes per provider: CPU {total} (of {total})" in _log(worker)


def test_setting_off_reports_nothing(ops_fleet: OpsFleet) -> None:
    port = free_port()
    config = ops_fleet.config(serve=("demo-lm",), models={"demo-lm": {"engine": {"report_placement": False}}})
    worker = ops_fleet.worker(config, metrics_port=port)

    assert _heartbeat(ops_fleet, worker.hostname)["nodes"] is None
    table = ops_fleet.fleet_cli(config, "status", module="producer.ops_cli")
    assert table.returncode == 0, table.stderr
    row = _worker_row(table.stdout, worker.hostname).split()
    assert row[row.index("CPU") + 1] == "-"  # PROVIDERS, then NODES
    samples = scrape(f"http://127.0.0.1:{port}/metrics")
    assert not [name for name, _ in samples if name == "fleet_engine_nodes"]
    assert "nodes per provider" not in _log(worker)


@pytest.mark.parametrize("report", [True, False])
def test_the_served_session_does_not_stay_profiled(ops_models: Any, report: bool) -> None:
    model = ops_models.lm
    engine = Engine(model, load_card(model), EngineSettings(intra_op_threads=1, report_placement=report),
                    BatchingSettings(), LimitSettings(max_input_tokens=64))  # fmt: skip
    assert engine.session.get_session_options().enable_profiling is report
    if report:
        assert engine.placement == _expected_nodes(model)
    else:
        assert engine.placement is None
    engine.warm_up()
    # ONNX Runtime answers an empty path when the session is not profiling: steady state runs are not profiled
    assert engine.session.end_profiling() == ""


def test_the_heartbeat_and_status_say_which_kv_cache_generates(ops_fleet: OpsFleet) -> None:
    """``kv_cache`` in the heartbeat and the KV CACHE column: the in-place cache's element type, where its slots
    live and their bytes (max_batch_size x the card's max_positions); ``concat`` when configured; nothing for
    an encoder."""
    config = ops_fleet.config(serve=("demo-lm", "demo-encoder"))
    lm = ops_fleet.worker(config, "demo-lm")
    encoder = ops_fleet.worker(config, "demo-encoder")
    card = load_card(ops_fleet.models.lm)
    slots = 2 * card.num_layers * 8 * card.kv_heads * card.max_positions * card.head_dim * 4  # max_batch_size 8
    beat = _heartbeat(ops_fleet, lm.hostname)["kv_cache"]
    assert beat == {"cache": "in_place", "dtype": "float32", "cuda_graphs": False, "memory": "host", "bytes": slots}
    assert _heartbeat(ops_fleet, encoder.hostname)["kv_cache"] is None
    table = ops_fleet.fleet_cli(config, "status", module="producer.ops_cli")
    assert table.returncode == 0, table.stderr
    assert "KV CACHE" in table.stdout.splitlines()[1]
    assert f"in place float32 host {slots / 2**20:.0f} MiB" in _worker_row(table.stdout, lm.hostname)
    concat = ops_fleet.config(serve=("demo-lm",), models={"demo-lm": {"engine": {"kv_cache": "concat"}}})
    other = ops_fleet.worker(concat, "demo-lm")
    assert _heartbeat(ops_fleet, other.hostname)["kv_cache"] == {"cache": "concat", "dtype": "float32",
                                                                 "cuda_graphs": False}
