"""README's metrics table names every ``fleet_*`` series a worker and the gateway expose, with their labels.

An operator builds dashboards and alerts from that table. Before, it listed 25 of the 53 series: the
readiness detail (``fleet_worker_held_slots``, ``fleet_worker_stalled``…), every generation series
(time to first token, generated tokens, finish reasons…), the stream publisher's and the canary gauges were
exposed but missing, so nobody knew to alert on them, and two rows left out their ``model`` label. Real
redis-server, real worker (one-step requests and a generation, so every labelled series has a child), real gateway.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from producer.client import FleetClient
from protocol.settings import load_settings
from tests.integration.ops_fixtures import OpsFleet, ops_fleet, ops_models, ops_redis, scrape, wait_until
from tools.redis_server import free_port

__all__ = ["ops_fleet", "ops_models", "ops_redis"]

README = Path(__file__).resolve().parents[2] / "README.md"
SERIES = re.compile(r"`(fleet_[a-z_]+)(?:\{([^}]*)\})?`")


def documented() -> dict[str, dict[str, set[str] | None]]:
    """The series in the first column of README's metrics table: name -> {label: allowed values (None = any)}
    ({} when the row names no labels). A counter is written with its ``_total``, as it is scraped; a label's
    values are ``\\|``-separated (a pipe in a table cell is escaped)."""
    section = README.read_text().split("### Metrics and dashboards", 1)[1].split("\n## ", 1)[0]
    out: dict[str, dict[str, set[str] | None]] = {}
    for line in section.splitlines():
        if not line.startswith("| `fleet_"):
            continue
        for name, labels in SERIES.findall(line.split(" | ", 1)[0].replace("\\|", "|")):
            spec: dict[str, set[str] | None] = {}
            for label in filter(None, (part.strip() for part in labels.split(","))):
                key, _, values = label.partition("=")
                spec[key] = set(values.split("|")) if values else None
            out[name] = spec
    return out


def exposed(url: str) -> dict[str, tuple[str, set[tuple[tuple[str, str], ...]]]]:
    """The ``fleet_*`` families at ``url``: scraped name (``_total`` on counters) -> (type, label sets)."""
    out: dict[str, tuple[str, set[tuple[tuple[str, str], ...]]]] = {}
    for family in text_string_to_metric_families(httpx.get(url, timeout=5).text):
        if not family.name.startswith("fleet_") or family.name.endswith("_created"):
            continue
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = {tuple(sorted((k, v) for k, v in s.labels.items() if k != "le")) for s in family.samples
                  if not s.name.endswith("_created")}  # fmt: skip
        out[name] = (family.type, labels)
    return out


def test_the_metrics_table_names_every_exposed_series_and_its_labels(ops_fleet: OpsFleet) -> None:
    config = ops_fleet.config()
    port = free_port()
    ops_fleet.worker(config, metrics_port=port)
    worker_url = f"http://127.0.0.1:{port}/metrics"
    gateway = ops_fleet.gateway(config)
    client = FleetClient(load_settings(config))
    try:
        ids = [client.submit("demo-lm", [5, 6, 7]), client.submit("demo-lm", [5, 6], generation={"max_new_tokens": 4})]
        for rid in ids:
            client.result(rid, wait=True, timeout_s=60)
    finally:
        client.close()
    succeeded = ("fleet_worker_requests_total", (("model", "demo-lm"), ("outcome", "succeeded")))
    wait_until(lambda: scrape(worker_url).get(succeeded) == 2, 30, "the worker to count both requests")
    series: dict[str, Any] = {**exposed(worker_url), **exposed(gateway.url + "/metrics")}
    table = documented()

    missing = sorted(set(series) - set(table))
    assert missing == [], f"exposed but not in README's metrics table: {missing}"
    assert sorted(set(table) - set(series)) == [], "in README's metrics table but not exposed"
    for name, spec in table.items():
        _, label_sets = series[name]
        for labels in label_sets:
            names = {k for k, _ in labels}
            if spec:
                assert names == set(spec), (name, labels, spec)
            for key, value in labels:
                allowed = spec.get(key)
                assert allowed is None or value in allowed, (name, key, value, allowed)
