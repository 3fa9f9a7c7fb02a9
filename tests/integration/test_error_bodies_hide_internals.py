"""What a caller reads when things fail names the field that broke, and never the gateway's insides: not
Redis's address, user or password (``/readyz`` is open to anyone), not the interpreter's settings. A real
``fleet api`` process on a Redis of its own, which the test kills."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from producer.streams import MAX_OUTAGE_S
from tests.integration.ops_fixtures import API_KEY, OpsFleet, ops_fleet, ops_models, wait_until
from tools.redis_server import EmbeddedRedis

__all__ = ["ops_fleet", "ops_models"]

AUTH = {"X-API-Key": API_KEY}
PASSWORD = "s3cret-pw"


@pytest.fixture
def ops_redis() -> Iterator[EmbeddedRedis]:
    """A Redis of the test's own, with a password (``ops_fleet`` runs on it; the test kills it)."""
    with EmbeddedRedis(password=PASSWORD) as server:
        yield server


def _secrets(server: EmbeddedRedis) -> list[str]:
    return [f"127.0.0.1:{server.port}", f"{server.port}.", "redis://", PASSWORD, "Connection refused"]


def _stream_frames(url: str) -> tuple[int, list[dict[str, Any]]]:
    with httpx.stream("GET", url, headers=AUTH, timeout=MAX_OUTAGE_S + 120) as resp:
        frames = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ")]
    return resp.status_code, frames


def test_a_redis_failure_is_answered_without_its_address(ops_fleet: OpsFleet, ops_redis: EmbeddedRedis) -> None:
    """Before: ``/readyz`` answered anyone ``Redis at redis://:***@127.0.0.1:PORT/0 unreachable: Error 111
    connecting to 127.0.0.1:PORT. Connection refused.``, and a stream cut by Redis ended with that error text."""
    gateway = ops_fleet.gateway(ops_fleet.config())  # no worker: the generation waits in its queue, its stream open
    generation = {"model": "demo-lm", "input_ids": [5, 6], "output": {"generation": {"max_new_tokens": 8}}}
    rid = httpx.post(gateway.url + "/v1/requests", json=generation, headers=AUTH).json()["request_id"]
    with ThreadPoolExecutor(1) as pool:
        streamed = pool.submit(_stream_frames, f"{gateway.url}/v1/requests/{rid}/stream")
        wait_until(lambda: ops_redis.client().exists(f"fleet:stream:{rid}") == 0 and gateway_reads(ops_redis),
                   30, "the relay to wait on the stream")  # fmt: skip
        ops_redis.kill()
        ready = httpx.get(gateway.url + "/readyz", timeout=30)
        submit = httpx.post(gateway.url + "/v1/requests", json=generation, headers=AUTH, timeout=30)
        models = httpx.get(gateway.url + "/v1/models", headers=AUTH, timeout=30)
        status, frames = streamed.result(timeout=MAX_OUTAGE_S + 120)
    assert ready.status_code == 503 and ready.json()["ready"] is False, ready.text
    assert submit.status_code == 503 and models.status_code == 503, (submit.text, models.text)
    assert status == 200 and frames[-1]["type"] == "error" and frames[-1]["field"] == "stream", frames
    for said in (ready.text, submit.text, models.text, json.dumps(frames[-1])):
        assert "unreachable" in said or "failed" in said, said
        assert not [s for s in _secrets(ops_redis) if s in said], said
    log = gateway.log_path.read_text()  # the operator still reads where and why
    assert f"127.0.0.1:{ops_redis.port}" in log and PASSWORD not in log


def gateway_reads(server: EmbeddedRedis) -> bool:
    """Some client of ``server`` waits in a blocking ``XREAD`` (the gateway's relay)."""
    return any(c.get("cmd") == "xread" for c in server.client().client_list())


def test_an_integer_too_long_to_parse_is_refused_naming_body(ops_fleet: OpsFleet) -> None:
    """Before: ``400 {"error": "http", "message": "There was an error parsing the body", "field": null}``."""
    gateway = ops_fleet.gateway(ops_fleet.config(api={"max_body_bytes": 65_536}))
    digits = sys.get_int_max_str_digits()
    raw = b'{"model": "demo-lm", "input_ids": [' + b"9" * (digits + 1) + b"]}"
    for path in ("/v1/requests", "/v1/completions"):
        resp = httpx.post(gateway.url + path, content=raw.replace(b"input_ids", b"prompt") if "compl" in path else raw,
                          headers={**AUTH, "Content-Type": "application/json"})  # fmt: skip
        assert resp.status_code in (400, 422), resp.text
        doc = resp.json()
        error = doc["error"] if path == "/v1/completions" else doc
        assert (error.get("field") or error.get("param")) == "body", error
        assert f"more than {digits} digits" in error["message"] and "sys." not in error["message"], error
