"""Flower on a real fleet: ``fleet flower`` with basic auth shows requests as JSON, the README's
example works in its order, and Flower remembers what it saw across a restart.

Real redis-server, a real ``demo-lm`` worker and a real Flower process on a free port.
"""

from __future__ import annotations

import ast
import html
import json
import re
import signal
import sys
from pathlib import Path
from typing import Any

import httpx

from producer.client import FleetClient
from producer.flower_config import as_json
from producer.ops_cli import FLOWER_TASKS_COLUMNS
from protocol.settings import load_settings
from tests.integration.ops_fixtures import ROOT, OpsFleet, ops_fleet, ops_models, ops_redis, wait_until
from tools.redis_server import free_port

__all__ = ["ops_fleet", "ops_models", "ops_redis"]

USER, PASSWORD = "ops", "flower-pw-1"
AUTH = (USER, PASSWORD)


class Flower:
    """``fleet flower`` for one test: its URL and process, and the JSON API with basic auth."""

    def __init__(self, fleet: OpsFleet, config: Path, db: Path, *, module: str = "producer.cli") -> None:
        self.port = load_settings(config).flower.port
        self.url = f"http://127.0.0.1:{self.port}"
        # started as the README says: `fleet flower` (settings give the port and the basic-auth users)
        cmd = [sys.executable, "-m", module, "flower", "--config", str(config), "--db", str(db)]
        self.proc = fleet.spawn(cmd, name="flower")

    def get(self, path: str, **params: str) -> httpx.Response:
        assert self.proc.poll() is None, "flower exited"
        return httpx.get(self.url + path, auth=AUTH, params=params, timeout=5)

    def wait_lists(self, hostname: str) -> None:
        def listed() -> bool:
            try:
                return hostname in self.get("/api/workers", refresh="true").json()
            except httpx.HTTPError:
                return False

        wait_until(listed, 60, f"Flower to list {hostname}", poll_s=0.3)

    def wait_up(self) -> None:
        """What the README waits for: the API answers (``until curl -sf ... /api/workers``)."""

        def answers() -> bool:
            try:
                return self.get("/api/workers").status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(answers, 60, "Flower to answer", poll_s=0.5)

    def wait_task(self, request_id: str, state: str = "SUCCESS") -> dict[str, Any]:
        def seen() -> dict[str, Any] | None:
            resp = self.get(f"/api/task/info/{request_id}")
            return resp.json() if resp.status_code == 200 and resp.json()["state"] == state else None

        info: dict[str, Any] = wait_until(seen, 30, f"Flower to show {request_id} as {state}", poll_s=0.3)
        return info

    def stop(self) -> None:
        """SIGTERM, as a service manager stops it: Flower saves its state on the way out."""
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(15)


def _flower_config(fleet: OpsFleet) -> Path:
    return fleet.config(flower={"port": free_port(), "basic_auth": [f"{USER}:{PASSWORD}"]})


def _stored_result(client: FleetClient, request_id: str) -> dict[str, Any]:
    """The result JSON the worker stored in the result backend."""
    result: dict[str, Any] = client.app.AsyncResult(request_id).result
    return result


def test_flower_with_basic_auth_shows_requests_and_results_as_json(ops_fleet: OpsFleet) -> None:
    config = _flower_config(ops_fleet)
    flower = Flower(ops_fleet, config, ops_fleet.tmp_path / "flower.db")
    worker = ops_fleet.worker(config)
    flower.wait_lists(worker.hostname)
    assert httpx.get(flower.url + "/api/tasks").status_code == 401
    assert httpx.get(flower.url + "/api/tasks", auth=(USER, "wrong")).status_code == 401
    cmdline = Path(f"/proc/{flower.proc.pid}/cmdline").read_bytes().decode().split("\0")  # what `ps` shows
    assert "--tasks_columns=" + ",".join(FLOWER_TASKS_COLUMNS) in cmdline
    assert not any(PASSWORD in arg or "redis://" in arg for arg in cmdline)  # auth and broker travel in env

    client = FleetClient(load_settings(config))
    try:
        ids = [
            client.submit("demo-lm", text="Hello fleet", top_k=3, request_id="hello-1"),
            client.submit("demo-lm", [5, 6, 7], request_id="ids-1"),
        ]
        assert all(client.result(rid, wait=True, timeout_s=30) is not None for rid in ids)
        token_ids = client.build_request("demo-lm", text="Hello fleet").input_ids
        stored = _stored_result(client, "hello-1")
    finally:
        client.close()

    def tasks_listed() -> dict[str, Any] | None:
        tasks: dict[str, Any] = flower.get("/api/tasks").json()
        return tasks if all(tasks.get(rid, {}).get("state") == "SUCCESS" for rid in ids) else None

    tasks = wait_until(tasks_listed, 30, "Flower to list the tasks as SUCCESS", poll_s=0.3)
    for rid in ids:
        assert tasks[rid]["name"] == "fleet.infer" and tasks[rid]["worker"] == worker.hostname
        assert tasks[rid]["routing_key"] == "fleet.demo-lm"

    # the API gives what Celery's events carried: the producer's JSON args, Celery's repr of the result
    info = flower.get("/api/task/info/hello-1").json()
    (request,) = json.loads(info["args"])
    assert request["text"] == "Hello fleet" and request["input_ids"] == token_ids and request["model"] == "demo-lm"
    assert ast.literal_eval(info["result"]) == stored and json.loads(as_json(info["result"]) or "") == stored

    # the Tasks page (its table feed) and the task page show JSON through format_task, outputs first
    page = flower.get("/tasks").text
    assert re.findall(r'<th data-column="(\w+)"', page) == list(FLOWER_TASKS_COLUMNS)
    table = flower.get(
        "/tasks/datatable",
        draw="1",
        start="0",
        length="15",
        **{"order[0][column]": "0", "columns[0][data]": "received"},
    ).json()
    rows = {row["uuid"]: row for row in table["data"]}
    assert set(rows) == set(ids)
    (shown_request,) = json.loads(rows["hello-1"]["args"])
    assert list(shown_request)[:2] == ["text", "input_ids"] and shown_request == request
    shown_result = json.loads(rows["hello-1"]["result"])
    assert shown_result == stored and next(iter(shown_result)) == "top_k"
    assert json.loads(rows["ids-1"]["args"])[0]["input_ids"] == [5, 6, 7] and "text" not in rows["ids-1"]["args"]
    task_page = html.unescape(flower.get("/task/hello-1").text)
    assert '[{"text": "Hello fleet", "input_ids": [' in task_page and '{"top_k": [{"token_id": ' in task_page


def test_readme_example_in_order_and_what_a_restart_remembers(ops_fleet: OpsFleet) -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### Flower") : readme.index("### Metrics and dashboards")]
    section = re.sub(r"<!--.*?-->", "", section, flags=re.DOTALL)  # the README tier's markers quote commands too
    steps = [
        ".venv/bin/fleet flower &",
        "until curl -sf -u admin:choose-a-password http://127.0.0.1:5555/api/workers",
        '.venv/bin/fleet submit --model demo-lm --text "Hello fleet" --request-id flower-1 --wait',
        "curl -s -u admin:choose-a-password http://127.0.0.1:5555/api/task/info/flower-1",
    ]
    assert all(step in section for step in steps)
    assert [section.index(step) for step in steps] == sorted(section.index(step) for step in steps)
    config = _flower_config(ops_fleet)
    db = ops_fleet.tmp_path / "var" / "flower.db"
    worker = ops_fleet.worker(config)

    def fleet_submit(request_id: str) -> None:
        args = ["submit", "--model", "demo-lm", "--text", "Hello fleet", "--request-id", request_id, "--wait"]
        done = ops_fleet.fleet_cli(config, *args)
        assert done.returncode == 0, done.stderr

    fleet_submit("before-1")  # submitted before Flower started: Flower never hears of it
    flower = Flower(ops_fleet, config, db)  # the README's steps, in order
    flower.wait_up()
    fleet_submit("flower-1")
    info = flower.wait_task("flower-1")
    assert json.loads(info["args"])[0]["text"] == "Hello fleet" and info["worker"] == worker.hostname
    before = flower.get("/api/task/info/before-1")
    assert before.status_code == 404 and "Unknown task 'before-1'" in before.text

    flower.stop()
    fleet_submit("while-down-1")  # its events go to nobody
    flower = Flower(ops_fleet, config, db, module="producer.ops_cli")
    flower.wait_lists(worker.hostname)
    remembered = flower.get("/api/task/info/flower-1").json()
    assert {k: remembered[k] for k in ("state", "args", "result", "worker")} == {
        k: info[k] for k in ("state", "args", "result", "worker")
    }
    assert flower.get("/api/task/info/while-down-1").status_code == 404
