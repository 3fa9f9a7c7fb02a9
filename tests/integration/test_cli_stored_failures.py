"""A request that was queued and then failed exits 1 ("the request failed"), whatever the worker's error:
a TokenOutOfRange read back from the result store is no bad input of ``fleet result`` or ``fleet submit
--wait`` (exit 2 is for what is refused before anything is queued). Real Redis; the worker's FAILURE is
stored the way a worker stores it."""

from __future__ import annotations

import json
import threading

import pytest

from producer.cli import main as fleet_main
from producer.client import FleetClient
from protocol.errors import InvalidRequest, TokenOutOfRange
from protocol.keys import REQUEST_KEY
from tests.integration.fleet_fixtures import Fleet

pytestmark = pytest.mark.timeout(120)


def _outcome(capsys: pytest.CaptureFixture[str]) -> tuple[dict[str, object], str]:
    """The error's JSON on stdout and the one ``fleet:`` line on stderr."""
    captured = capsys.readouterr()
    lines = [x for x in captured.err.splitlines() if x.startswith("fleet:") and "warning" not in x]
    assert len(lines) == 1, captured.err
    return json.loads(captured.out.strip().splitlines()[-1]), lines[0]


@pytest.mark.parametrize("error", [
    TokenOutOfRange("token 900 is outside [0, 512)", "input_ids", 512),
    InvalidRequest("the worker refused it", "input_ids", None),
])  # fmt: skip
def test_a_stored_failure_read_by_fleet_result_exits_1(
    error: InvalidRequest, fleet: Fleet, capsys: pytest.CaptureFixture[str]
) -> None:
    config = fleet.config()
    client = fleet.client(config)
    client.app.backend.mark_as_failure("failed-1", error)
    for wait in ([], ["--wait", "--timeout", "5"]):
        code = fleet_main(["result", "failed-1", "--config", str(config), *wait])
        doc, line = _outcome(capsys)
        assert code == 1 and doc["type"] == type(error).__name__ and error.message in line, (code, doc, line)


def test_submit_wait_exits_1_when_the_worker_refuses(fleet: Fleet, capsys: pytest.CaptureFixture[str]) -> None:
    config = fleet.config()
    client = fleet.client(config)
    rid = "refused-1"
    refused = threading.Event()

    def worker_refuses(c: FleetClient = client) -> None:  # stands in for a worker: FAILURE once it is queued
        for _ in range(20_000):
            if c.redis.exists(REQUEST_KEY.format(id=rid)):
                c.app.backend.mark_as_failure(rid, TokenOutOfRange("token 7 is outside [0, 5)", "input_ids", 5))
                refused.set()
                return
            refused.wait(0.005)

    thread = threading.Thread(target=worker_refuses, daemon=True)
    thread.start()
    code = fleet_main(["submit", "--config", str(config), "--model", "demo-lm", "--tokens", "5,6,7",
                       "--request-id", rid, "--wait", "--timeout", "30"])  # fmt: skip
    thread.join(10)
    doc, line = _outcome(capsys)
    assert refused.is_set() and code == 1 and doc["type"] == "TokenOutOfRange", (code, doc, line)
    # refused before anything is queued: still exit 2
    assert fleet_main(["submit", "--config", str(config), "--model", "demo-lm", "--tokens", "5,x"]) == 2
