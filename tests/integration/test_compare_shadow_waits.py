"""``fleet models compare --shadow``: refused at once when no live worker can answer, unfinished requests
cancelled when the wait ends, progress shown on a terminal, ``--prompts`` checked with or without a canary.

Before, with a canary set and no live worker, ``compare demo-lm --shadow 2`` printed nothing for 120 s, exited 0
with ``"compared": 0, "failed": 2`` and left its 4 requests queued, to run later for nobody; ``--prompts FILE``
was never read without a canary. Real redis-server, ``fleet`` in this process (as ``fleet models`` tests run it)
and as a subprocess on a pseudo-terminal; a real worker shows that the cancelled requests never run. A "live
worker" that never takes anything is a heartbeat document written here: it makes the end of the wait certain.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from producer.cli import main as fleet_main
from protocol.errors import RequestCancelled
from protocol.keys import REQUEST_KEY, WORKER_KEY_PREFIX
from protocol.model_state import pin, set_canary
from tests.integration.fleet_fixtures import Fleet
from tests.integration.ops_fixtures import wait_until

MODEL = "demo-lm"
CANARY = "2.0.0"
SERVED = "1.0.0"  # what a worker of the demo LM's file serves
FAKE = "never-takes@test"


def compare(capsys: pytest.CaptureFixture[str], cfg: Path, *argv: str) -> tuple[int, Any, str]:
    """``fleet models compare demo-lm ARGV`` in this process: exit code, the JSON it printed (or None), stderr."""
    code = fleet_main(["models", "compare", MODEL, "--config", str(cfg), *argv])
    captured = capsys.readouterr()
    out = captured.out.strip().splitlines()
    return code, json.loads(out[-1]) if out else None, captured.err


def beat(r: redis.Redis[bytes], version: str, canary: str | None) -> None:
    """A live worker's heartbeat as :mod:`workers.health` writes it, of a worker that takes nothing."""
    r.set(WORKER_KEY_PREFIX + FAKE, json.dumps({"hostname": FAKE, "model": MODEL, "version": version,
                                                "canary_version": canary, "ready": True}))  # fmt: skip


def queued(r: redis.Redis[bytes]) -> tuple[int, int]:
    """(request markers, messages in the model's stable and canary queue lists, kombu's priority lists too)."""
    markers = len(list(r.scan_iter(REQUEST_KEY.format(id="*"), count=1000)))
    return markers, sum(int(r.llen(k)) for k in r.scan_iter(f"fleet.{MODEL}*", count=1000) if r.type(k) == b"list")


@pytest.mark.timeout(60)  # the refusal comes before any wait: this never sits out SHADOW_TIMEOUT_S (120 s)
@pytest.mark.parametrize(
    ("stable", "beat_versions", "said"),
    [
        (None, None, f"no live worker serves model '{MODEL}': the shadow sample would wait in fleet.{MODEL} and "
                     f"fleet.{MODEL}.canary until one starts, so nothing was sent (start one: `fleet worker --model "
                     f"{MODEL}`; `fleet status` lists the workers)"),
        (None, (SERVED, None), f"no live worker of model '{MODEL}' serves its canary {CANARY} (none has it "
                               "loaded): no shadow pair could be compared, so nothing was sent (start one:"),
        ("3.0.0", (SERVED, CANARY), f"no live worker of model '{MODEL}' serves its stable version 3.0.0 (they "
                                    f"serve {SERVED}): no shadow pair could be compared, so nothing was sent"),
    ],
    ids=["no-worker", "canary-not-loaded", "stable-not-served"],
)
def test_compare_refuses_at_once_when_no_live_worker_serves_both_versions(
    fleet: Fleet, capsys: pytest.CaptureFixture[str], stable: str | None, beat_versions: tuple[str, str | None] | None,
    said: str,
) -> None:
    cfg = fleet.config()
    r = redis.Redis.from_url(fleet.redis_url)
    if stable is not None:
        pin(r, MODEL, stable, "test@compare")
    set_canary(r, MODEL, CANARY, 10, "test@compare")
    if beat_versions is not None:
        beat(r, *beat_versions)

    code, doc, err = compare(capsys, cfg, "--shadow", "2")

    assert code == 1, err  # as a pin no live worker serves (NOT SERVED)
    assert doc["shadow"]["not_served"].startswith(said), doc["shadow"]
    assert doc["shadow"]["compared"] == 0 and doc["shadow"]["prompts"] == 2
    assert err.strip().splitlines() == [f"fleet: NOT SERVED: {doc['shadow']['not_served']}"]  # one line
    assert f"`fleet worker --model {MODEL}`" in err
    assert queued(r) == (0, 0)  # nothing sent


@pytest.mark.timeout(60)
def test_compare_reads_the_prompts_file_with_or_without_a_canary(
    fleet: Fleet, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = fleet.config()
    r = redis.Redis.from_url(fleet.redis_url)
    missing = tmp_path / "nonexistent.json"
    code, doc, err = compare(capsys, cfg, "--prompts", str(missing))  # no canary: it was never read
    assert code == 2 and f"--prompts {missing}: cannot read a JSON list" in err, err
    assert doc["type"] == "InvalidRequest" and doc["field"] == "prompts"
    not_a_list = tmp_path / "prompts.json"
    not_a_list.write_text('{"prompt": [5, 6]}')
    code, _, err = compare(capsys, cfg, "--prompts", str(not_a_list))
    assert code == 2 and "--prompts" in err and "must be a non-empty JSON list" in err, err
    code, doc, err = compare(capsys, cfg, "--shadow", "2")  # no canary: said, not a bare "shadow": null
    assert code == 0 and doc["shadow"] is None and f"no shadow sample sent: model '{MODEL}' has no canary" in err, err

    set_canary(r, MODEL, CANARY, 10, "test@compare")
    beat(r, SERVED, CANARY)
    code, _, err = compare(capsys, cfg, "--prompts", str(missing))
    assert code == 2 and f"--prompts {missing}: cannot read a JSON list" in err, err
    assert queued(r) == (0, 0)


@pytest.mark.timeout(120)
def test_unfinished_shadow_requests_are_cancelled_and_never_run(
    fleet: Fleet, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = fleet.config()
    r = redis.Redis.from_url(fleet.redis_url)
    set_canary(r, MODEL, CANARY, 10, "test@compare")
    beat(r, SERVED, CANARY)  # live, serving both versions, taking nothing: the wait ends at its deadline

    code, doc, err = compare(capsys, cfg, "--shadow", "2", "--shadow-timeout-s", "0.2")

    shadow = doc["shadow"]
    assert code == 1, err  # no pair compared
    assert (shadow["prompts"], shadow["compared"], shadow["failed"]) == (2, 0, 2)
    assert (shadow["unfinished"], shadow["cancelled"], shadow["not_served"]) == (4, 4, None)
    assert "4 of the 4 shadow requests had no result within 0.2 s (--shadow-timeout-s): cancelled 4" in err, err
    assert "no shadow pair was compared" in err and len(err.strip().splitlines()) == 1
    client = fleet.client(cfg)
    ids = [key.decode().removeprefix(REQUEST_KEY.format(id="")) for key in r.scan_iter(REQUEST_KEY.format(id="*"))]
    assert len(ids) == 4 and {client.status(rid).value for rid in ids} == {"cancelled"}

    # a worker that starts later takes them off both queues and runs none of them
    r.delete(WORKER_KEY_PREFIX + FAKE)
    fleet.worker(cfg)
    backend = client.app.backend

    def stored() -> list[dict[str, Any]] | None:
        raws = r.mget([backend.get_key_for_task(rid) for rid in ids])
        return [backend.decode_result(raw) for raw in raws] if all(raws) else None

    metas = wait_until(stored, 60, "the worker to store how the cancelled shadow requests ended")
    assert [type(client.outcome_of(rid, m)) for rid, m in zip(ids, metas, strict=True)] == [RequestCancelled] * 4
    assert queued(r)[1] == 0


@pytest.mark.timeout(120)
def test_the_wait_shows_progress_on_a_terminal(fleet: Fleet) -> None:
    cfg = fleet.config()
    r = redis.Redis.from_url(fleet.redis_url)
    set_canary(r, MODEL, CANARY, 10, "test@compare")
    beat(r, SERVED, CANARY)
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 0 columns: tqdm draws nothing
    proc = subprocess.Popen(
        [sys.executable, "-m", "producer.cli", "models", "compare", MODEL, "--config", str(cfg), "--shadow", "1",
         "--shadow-timeout-s", "1"],
        stdout=subprocess.PIPE, stderr=terminal,
    )
    os.close(terminal)
    said = b""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:  # read the terminal until the command closes it
        ready, _, _ = select.select([controller], [], [], 1.0)
        if not ready:
            continue
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # EIO: every writer closed it
            break
        if not chunk:
            break
        said += chunk
    os.close(controller)
    out, _ = proc.communicate(timeout=30)
    text = said.decode(errors="replace")
    assert proc.returncode == 1, text
    assert f"shadow {MODEL}:" in text and "0/2" in text, text  # the bar, drawn while it waited
    assert "cancelled 2" in text, text
    assert json.loads(out.decode().strip().splitlines()[-1])["shadow"]["cancelled"] == 2
