"""``fleet models canary`` waits for the workers, as ``pin`` does, and says what serves each queue.

A real worker follows versions published to a real S3 server (SeaweedFS). A canary it can load: the
command returns once the worker has it loaded and names it under ``canary_served``, exit 0. A canary whose
file fails its checksum (corrupted in the store): the command waits for the worker's refusal, says that
the canary queue runs on stable (``not_served``, and ``fleet: NOT SERVED: …`` on stderr) and exits 1,
the canary still recorded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import redis

from producer.cli import main as fleet_main
from protocol.keys import WORKER_KEY_PREFIX
from protocol.model_state import read_state, refusals
from tests.integration.fleet_fixtures import Fleet
from tests.integration.lifecycle_fixtures import BUCKET, lifecycle_config, publish
from tests.integration.model_versions import MODEL
from tools.seaweed_server import EmbeddedSeaweed

HOST = "w1-canary-cli@test"


def _canary(capsys: pytest.CaptureFixture[str], config: Path, *argv: str) -> tuple[int, dict[str, Any], str]:
    """Run ``fleet models canary MODEL …`` in this process: exit code, its JSON document, stderr."""
    capsys.readouterr()
    code = fleet_main(["models", "canary", MODEL, *argv, "--config", str(config)])
    out = capsys.readouterr()
    return code, json.loads(out.out.strip().splitlines()[-1]), out.err


def _show(capsys: pytest.CaptureFixture[str], code: int, doc: dict[str, Any], err: str) -> None:
    with capsys.disabled():  # the verdict, outside what the test reads from fleet's output
        print(f"\ncanary {doc['state']['canary']}: exit {code}; served {doc.get('served')}, canary_served "
              f"{doc.get('canary_served')}, not_served {doc.get('not_served')}; stderr {err.strip()!r}")


def _beat(r: redis.Redis[bytes]) -> dict[str, object]:
    doc: dict[str, object] = json.loads(r.get(WORKER_KEY_PREFIX + HOST) or b"{}")
    return doc


def test_canary_waits_until_the_worker_loads_it_or_refuses_it_and_exits_1_when_none_loaded_it(
    fleet: Fleet, s3: EmbeddedSeaweed, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stable, good, bad = (publish(s3, tmp_path, scale) for scale in (1.0, 2.0, 3.0))
    key = f"{MODEL}/{bad.version}/{MODEL}-{bad.version}.onnx"
    original = s3.client().get_object(Bucket=BUCKET, Key=key)["Body"].read()
    s3.client().put_object(Bucket=BUCKET, Key=key, Body=original[:-8] + b"tampered")
    cfg = lifecycle_config(fleet, s3, stable.version, tmp_path / "cache")
    fleet.worker(cfg, MODEL, hostname=HOST)
    r = redis.Redis.from_url(fleet.redis_url)
    assert _beat(r).get("version") == stable.version and _beat(r).get("canary_version") is None

    # a canary the worker can load: the command returns once it is loaded, and says so
    code, doc, err = _canary(capsys, cfg, good.version, "--weight", "30", "--wait-s", "60")
    _show(capsys, code, doc, err)
    assert _beat(r).get("canary_version") == good.version, "returned before the worker loaded the canary"
    assert code == 0, err
    assert doc["served"] == {stable.version: [HOST]} and doc["canary_served"] == {good.version: [HOST]}
    assert doc["not_served"] is None and err == ""

    # a canary that fails its checksum: it waits for the refusal, says what runs the canary queue, exits 1
    code, doc, err = _canary(capsys, cfg, bad.version, "--weight", "30", "--wait-s", "60")
    _show(capsys, code, doc, err)
    assert [x.worker for x in refusals(r, MODEL) if x.version == bad.version] == [HOST], \
        "returned before the worker refused the canary"
    assert code == 1, (doc, err)
    assert doc["served"] == {stable.version: [HOST]} and doc["canary_served"] == {}  # the replaced canary left
    assert doc["not_served"] == (f"canary {bad.version} is not loaded by {HOST} (their canary queue runs on "
                                 f"stable {stable.version}); refused by {HOST} (ChecksumMismatch)")
    assert err == f"fleet: NOT SERVED: {doc['not_served']}\n"
    state = read_state(r, MODEL)  # recorded all the same: `fleet models rollback` undoes it
    assert state is not None and (state.canary, state.canary_weight) == (bad.version, 30)

    # --wait-s 0: recorded, not waited for, not judged (one read of the heartbeats)
    code, doc, err = _canary(capsys, cfg, good.version, "--weight", "10", "--wait-s", "0")
    assert code == 0 and doc["state"]["canary"] == good.version and err == "", (doc, err)
