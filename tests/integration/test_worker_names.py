"""One live worker per Celery hostname (:mod:`workers.namesakes`), on a real redis-server and real workers.

Before, ``fleet worker --model demo-lm`` started twice on one host ran two workers both named
``demo-lm@<host>``: one heartbeat key and one live-set entry for two processes, and when either stopped
it deleted them, so the other read as gone ("no live worker serves model 'demo-lm'") until its next
beat. A README run caught it: the gateway answered a submit with that warning while a worker served it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import redis

from protocol.keys import LIVE_WORKERS_KEY, WORKER_KEY_PREFIX
from tests.integration.fleet_fixtures import Fleet
from tools.processes import poll_until
from workers.health import Heartbeat
from workers.namesakes import free_worker_name, live_namesake

MODEL = "demo-lm"


def _beat(r: redis.Redis[bytes], hostname: str) -> dict[str, object]:
    return dict(json.loads(r.get(WORKER_KEY_PREFIX + hostname) or b"{}"))


def _ready(r: redis.Redis[bytes], hostname: str) -> bool:
    return _beat(r, hostname).get("ready") is True


def test_a_second_worker_under_a_live_name_refuses_to_start_naming_it(fleet: Fleet) -> None:
    cfg = fleet.config()
    r: redis.Redis[bytes] = redis.Redis.from_url(fleet.redis_url)
    first = fleet.worker(cfg, MODEL, hostname="same@test")
    instance = _beat(r, "same@test")["instance"]
    second = fleet.worker(cfg, MODEL, hostname="same@test", wait=False)
    assert second.proc is not None
    assert second.proc.wait(timeout=120) == 3, second.log_tail()
    log = second.log_tail(20_000)
    assert "a worker named same@test is already running" in log and "--hostname" in log, log
    assert _beat(r, "same@test")["instance"] == instance  # the first one's heartbeat, untouched
    assert r.zscore(LIVE_WORKERS_KEY.format(model=MODEL), "same@test") is not None
    assert first.proc is not None and first.proc.poll() is None


def test_fleet_worker_without_a_name_takes_a_free_one_and_a_stop_leaves_the_other_live(
    fleet: Fleet, tmp_path: Path
) -> None:
    cfg = fleet.config()
    r: redis.Redis[bytes] = redis.Redis.from_url(fleet.redis_url)
    host = socket.gethostname()
    env = {**os.environ, "FLEET_CONFIG": str(cfg)}
    procs = []
    try:
        for n in (1, 2):
            log = (tmp_path / f"cli-worker-{n}.log").open("wb")
            procs.append(subprocess.Popen([sys.executable, "-m", "producer.cli", "worker", "--model", MODEL,
                                           "--concurrency", "8", "--config", str(cfg)],
                                          env=env, stdout=log, stderr=subprocess.STDOUT))  # fmt: skip
            name = f"{MODEL}@{host}" if n == 1 else f"{MODEL}-2@{host}"
            poll_until(partial(_ready, r, name), 120, f"{name} ready")
        live = LIVE_WORKERS_KEY.format(model=MODEL)
        assert {m.decode() for m in r.zrange(live, 0, -1)} >= {f"{MODEL}@{host}", f"{MODEL}-2@{host}"}
        procs[1].send_signal(signal.SIGTERM)  # warm shutdown of the second
        assert procs[1].wait(timeout=60) == 0
        assert _ready(r, f"{MODEL}@{host}")  # the first's heartbeat is its own: the stop left it
        assert r.zscore(live, f"{MODEL}@{host}") is not None
        assert r.get(WORKER_KEY_PREFIX + f"{MODEL}-2@{host}") is None
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=60)


def test_a_stop_leaves_a_namesake_s_heartbeat_and_live_entry(fleet: Fleet) -> None:
    r: redis.Redis[bytes] = redis.Redis.from_url(fleet.redis_url)
    doc = {"hostname": "n@test", "model": MODEL, "instance": "another-process", "heartbeat_unix_s": time.time(),
           "heartbeat_s": 2.0}  # fmt: skip
    r.set(WORKER_KEY_PREFIX + "n@test", json.dumps(doc), ex=60)
    r.zadd(LIVE_WORKERS_KEY.format(model=MODEL), {"n@test": time.time() + 60})
    mine = Heartbeat(r, "n@test", lambda: {"model": MODEL}, 2.0)
    mine._model = MODEL  # as after its first beat, which the namesake's has since replaced
    mine.stop()
    assert _beat(r, "n@test")["instance"] == "another-process"
    assert r.zscore(LIVE_WORKERS_KEY.format(model=MODEL), "n@test") is not None
    alone = Heartbeat(r, "m@test", lambda: {"model": MODEL}, 2.0)
    alone.beat()
    alone.stop()  # its own: removed
    assert r.get(WORKER_KEY_PREFIX + "m@test") is None
    assert r.zscore(LIVE_WORKERS_KEY.format(model=MODEL), "m@test") is None


def test_a_stale_heartbeat_does_not_hold_its_name(fleet: Fleet) -> None:
    """A SIGKILLed worker's heartbeat lingers for its TTL (three periods); past 2.5 periods without a beat
    its name is free again, so the restarted worker keeps it."""
    r: redis.Redis[bytes] = redis.Redis.from_url(fleet.redis_url)
    fresh = {"instance": "a", "heartbeat_unix_s": time.time(), "heartbeat_s": 2.0}
    stale = {"instance": "b", "heartbeat_unix_s": time.time() - 10, "heartbeat_s": 2.0}
    r.set(WORKER_KEY_PREFIX + "x@h", json.dumps(fresh), ex=60)
    r.set(WORKER_KEY_PREFIX + "x-2@h", json.dumps(fresh), ex=60)
    r.set(WORKER_KEY_PREFIX + "y@h", json.dumps(stale), ex=60)
    assert free_worker_name(r, "x", "h") == "x-3@h"
    assert free_worker_name(r, "y", "h") == "y@h"


def test_a_killed_worker_s_name_is_taken_over_once_its_heartbeat_is_stale(fleet: Fleet) -> None:
    """The heartbeat a SIGKILLed worker left is watched, not trusted: it never beats again, so once it is 2.5
    periods old the restarted worker starts under the name; a heartbeat that beats again is a live worker."""
    r: redis.Redis[bytes] = redis.Redis.from_url(fleet.redis_url)
    clock = [1000.5]

    def sleep(s: float) -> None:
        clock[0] += s

    r.set(WORKER_KEY_PREFIX + "k@h", json.dumps({"instance": "dead", "heartbeat_unix_s": 1000.0, "heartbeat_s": 2.0}))
    assert live_namesake(r, "k@h", clock=lambda: clock[0], sleep=sleep) is None
    assert clock[0] >= 1005.0  # it waited for the heartbeat to grow stale (2.5 periods)

    def beating(s: float) -> None:  # the namesake beats while we watch
        clock[0] += s
        r.set(WORKER_KEY_PREFIX + "k@h", json.dumps({"instance": "alive", "heartbeat_unix_s": clock[0],
                                                     "heartbeat_s": 2.0}))  # fmt: skip

    clock[0] = 1000.5
    r.set(WORKER_KEY_PREFIX + "k@h", json.dumps({"instance": "alive", "heartbeat_unix_s": 1000.0, "heartbeat_s": 2.0}))
    found = live_namesake(r, "k@h", clock=lambda: clock[0], sleep=beating)
    assert found is not None and found["instance"] == "alive"


def test_a_beat_never_takes_a_name_a_live_worker_of_another_process_holds(fleet: Fleet) -> None:
    """The check before start and the first beat are apart by the model's load: two workers started under one
    name at the same instant both passed the check. The beat itself is the claim (one script in Redis): the
    second to beat finds the first's live heartbeat, writes nothing, and gets it back to refuse with."""
    r: redis.Redis[bytes] = redis.Redis.from_url(fleet.redis_url)
    live = LIVE_WORKERS_KEY.format(model=MODEL)
    first = Heartbeat(r, "twin@test", lambda: {"model": MODEL, "pid": 111}, 2.0)
    second = Heartbeat(r, "twin@test", lambda: {"model": MODEL, "pid": 222}, 2.0)
    assert first.claim() is None
    held = second.claim()
    assert held is not None and held["instance"] == first.instance and held["pid"] == 111
    assert _beat(r, "twin@test")["instance"] == first.instance  # untouched
    entry = r.zscore(live, "twin@test")
    second.beat()  # a later beat of the loser: still nothing written
    assert _beat(r, "twin@test")["instance"] == first.instance and r.zscore(live, "twin@test") == entry
    first.beat()
    assert _beat(r, "twin@test")["instance"] == first.instance
    stale = {**_beat(r, "twin@test"), "heartbeat_unix_s": time.time() - 10}  # its process stopped beating
    r.set(WORKER_KEY_PREFIX + "twin@test", json.dumps(stale), ex=60)
    assert second.claim() is None  # a stale heartbeat frees the name, as the check reads it
    assert _beat(r, "twin@test")["instance"] == second.instance
    assert r.zscore(live, "twin@test") is not None


def test_two_workers_started_at_once_under_one_name_leave_one_running(fleet: Fleet) -> None:
    """Both start before either beats; exactly one serves the name, the other exits 3 naming it, and the
    heartbeat is the survivor's."""
    cfg = fleet.config()
    r: redis.Redis[bytes] = redis.Redis.from_url(fleet.redis_url)
    twins = [fleet.worker(cfg, MODEL, hostname="twin@race", wait=False) for _ in range(2)]
    procs = [t.proc for t in twins]
    assert all(p is not None for p in procs)

    def one_refused() -> bool:
        return any(p is not None and p.poll() is not None for p in procs)

    poll_until(one_refused, 180, "one of two same-named workers to exit")
    refused = next(t for t in twins if t.proc is not None and t.proc.poll() is not None)
    survivor = next(t for t in twins if t is not refused)
    assert refused.proc is not None and refused.proc.returncode == 3, refused.log_tail()
    assert "a worker named twin@race is already running" in refused.log_tail(20_000)
    survivor.wait_ready(120)
    assert survivor.proc is not None and survivor.proc.poll() is None
    assert _beat(r, "twin@race")["pid"] == survivor.proc.pid


def test_a_worker_frozen_while_another_took_its_name_stops_when_it_wakes(fleet: Fleet) -> None:
    """A worker stopped (SIGSTOP, a frozen VM) past its heartbeat's staleness loses its name to a worker started
    under it. Woken, it used to log once that its beats are not published, and went on taking requests: unseen
    by every probe and status, its generations' claims and its deliveries' visibility no longer renewed (so each
    generation it took ran twice). Now it stops, as a second process under a live name is refused at start."""
    cfg = fleet.config()
    r: redis.Redis[bytes] = redis.Redis.from_url(fleet.redis_url)
    frozen = fleet.worker(cfg, MODEL, hostname="frozen@test")
    assert frozen.proc is not None
    frozen_instance = _beat(r, "frozen@test")["instance"]
    frozen.proc.send_signal(signal.SIGSTOP)
    try:  # the taker starts once the frozen one's beat is stale (its own check waits for that)
        taker = fleet.worker(cfg, MODEL, hostname="frozen@test", wait=False)
        poll_until(lambda: _beat(r, "frozen@test").get("instance") not in (None, frozen_instance)
                   and _ready(r, "frozen@test"), 120, "the taker's ready beat under the name")  # fmt: skip
        taken_by = _beat(r, "frozen@test")["instance"]
    finally:
        frozen.proc.send_signal(signal.SIGCONT)
    assert frozen.proc.wait(timeout=120) is not None
    log = frozen.log_tail(20_000)
    assert "runs under this name now: this worker stops" in log, log
    assert taker.proc is not None and taker.proc.poll() is None
    assert _beat(r, "frozen@test")["instance"] == taken_by  # the frozen one's stop left the taker's beat alone
    client = fleet.client(cfg)
    assert client.result(client.submit(MODEL, [4, 5, 6]), wait=True, timeout_s=60) is not None
