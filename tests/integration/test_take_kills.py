"""A worker SIGKILLed at any instant of its take loses no message: 200 kills at random instants of a
process taking a backed-up queue through the worker's real channel (:mod:`broker.atomic_take`, the
batched take, the guard, the store script's ack) against a real redis-server, then a ledger of every
queued ID: in exactly one of the queue, kombu's unacked hash, or stored (delivered and acked).

The victim (:mod:`tests.integration.take_victim`) forks one child per kill, so that 200 kills of a
process that really runs the fleet's take fit in well under a minute; ``-s`` prints the figures.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import redis

from tests.integration.take_victim import MODEL, PUSHED_KEY
from tools.ledger import Ledger
from tools.redis_server import EmbeddedRedis

ROOT = Path(__file__).resolve().parents[2]
KILLS = 200
TOKENS = 4
QUEUE = f"fleet.{MODEL}"


def _victim(mode: str, server: EmbeddedRedis, out: Path, *extra: str) -> dict[str, Any]:
    subprocess.run(
        [sys.executable, "-m", "tests.integration.take_victim", mode, "--redis-url", server.url, "--out", str(out),
         "--tokens", str(TOKENS), *extra],
        cwd=ROOT, check=True, timeout=240,
    )
    report: dict[str, Any] = json.loads(out.read_text())
    assert Path(report["poison_module"]).resolve().is_relative_to(ROOT), report["poison_module"]  # this tree's code
    return report


def _places(r: redis.Redis[bytes]) -> tuple[set[str], Counter[str]]:
    """The pushed IDs, and how many of the three places (queue, unacked hash, stored result) hold each."""
    pushed = {m.decode() for m in r.smembers(PUSHED_KEY)}
    held: Counter[str] = Counter(json.loads(raw)["headers"]["id"] for raw in r.lrange(QUEUE, 0, -1))
    held.update(json.loads(entry)[0]["headers"]["id"] for entry in r.hvals("unacked"))
    ids = sorted(pushed)
    metas = r.mget([f"celery-task-meta-{tid}" for tid in ids]) if ids else []
    held.update(tid for tid, meta in zip(ids, metas, strict=True) if meta is not None)
    return pushed, held


def test_sigkill_at_random_instants_of_the_batched_take_loses_no_message(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    assert QUEUE == "fleet.demo-lm"
    report = _victim("kill", redis_server, tmp_path / "kills.json", "--kills", str(KILLS), "--depth", "64")
    r = redis_server.client()
    pushed, held = _places(r)
    lost = sorted(tid for tid in pushed if held[tid] == 0)
    twice = sorted(tid for tid in pushed if held[tid] > 1)
    print(f"\nkills {report['kills']}, pushed {len(pushed)}, lost {len(lost)}, in two places {len(twice)}, "
          f"kills that lost {report['kills_that_lost']}")
    print("landed:", report["landed"])
    print("lost by where the kill landed:", report["lost_by_where_landed"])
    assert report["kills"] == KILLS and report["killed_by_sigkill"] == KILLS
    assert sum(1 for k in report["per_kill"] if k["landed"] != report["per_kill"][0]["landed"]) > 0  # not one spot
    assert int(r.hlen("unacked")) > 0  # some kills left taken messages behind: the ledger saw them there
    ledger = Ledger(r, queues=[QUEUE])
    for tid in pushed:
        ledger.accepted(tid)
    assert ledger.check().kinds().get("lost", 0) == len(lost)
    assert not lost, f"{len(lost)} of {len(pushed)} IDs in no queue, not unacked, not stored: {lost[:5]}"
    assert not twice, twice[:5]

    # what kombu's visibility-timeout restore does for the dead: every ID is then served
    drained = _victim("drain", redis_server, tmp_path / "drain.json")
    print(f"restored {drained['restored']}, then stored {drained['stored']} of {drained['pushed']}")
    final = ledger.check()
    assert final.ok, final.violations[:5]
    assert final.terminal == {"SUCCESS": len(pushed)}
