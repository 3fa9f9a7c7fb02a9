"""The fault matrix: real redis-server, real Celery workers, real ONNX Runtime; one fault per test.

Each test drives steady load (:class:`~tests.integration.fault_fixtures.Load`), injects one fault,
waits for every accepted request, and writes its row (fault, how injected, load, accepted /
completed / lost / duplicated, refused, time to recover) to ``var/reliability/<name>.json``;
``make reliability`` renders the rows into docs/reliability.md. *Time to recover* is from the end of
the fault (the kill, SIGCONT, the link back up, the disk freed, Redis back) until a request submitted
then was accepted and completed.

The network-cut, full-disk and memory-limit tests need root (``ip netns``, ``mount -t tmpfs``,
raising no limit but setting RLIMIT_AS on another process); without it they skip, saying why.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import redis

from producer.client import FleetClient
from producer.deadletter import DeadLetterStore
from protocol.keys import WORKER_KEY_PREFIX
from protocol.messages import InferenceResult
from tests.integration.fault_fixtures import (
    FaultRecord,
    Load,
    audit,
    probe_recovery,
    record,
    settle,
    succeeded_twice,
)
from tests.integration.fleet_fixtures import Fleet
from tests.integration.ops_fixtures import wait_until
from tools.build_encoder import build_encoder
from tools.processes import WorkerProcess, poll_until
from tools.redis_server import EmbeddedRedis

VISIBILITY_S = 5
RATE = 20.0
# each worker holds up to half a second of traffic in its batch window, so a fault always catches some
WINDOW = {"models": {"demo-lm": {"batching": {"max_wait_ms": 500, "close_when_idle": False}}}}
IS_ROOT = os.geteuid() == 0
HEADROOM_MIB = 256


def _cfg(fleet: Fleet, **extra: object) -> Path:
    return fleet.config(visibility_timeout_s=VISIBILITY_S, worker={"heartbeat_s": 0.5}, **WINDOW, **extra)


def _in_flight(r: redis.Redis[bytes], hostname: str) -> int:
    raw = r.get(WORKER_KEY_PREFIX + hostname)
    return int(json.loads(raw)["in_flight"]) if raw else -1


def _accepted_at_least(load: Load, n: int) -> bool:
    return len(load.accepted) >= n


def _recover_or_replace(
    fleet: Fleet, cfg: Path, client: FleetClient, w: WorkerProcess, since: float
) -> tuple[float | None, WorkerProcess | None]:
    """Time to recover when ``w`` survived the fault; else (None, a replacement worker), as a supervisor would."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and w.proc is not None and w.proc.poll() is None:
        try:
            return probe_recovery(client, since, timeout_s=2.0), None
        except TimeoutError:
            continue
    if w.proc is not None and w.proc.poll() is None:
        return None, None
    return None, fleet.worker(cfg)


def _wait_idle_or_gone(r: redis.Redis[bytes], w: WorkerProcess, timeout_s: float = 15.0) -> None:
    """Wait until ``w`` has exited or a heartbeat of its own reports nothing in flight (its key expires within
    three beats, so a 0 read after an outage was written after it); after ``timeout_s`` count what it logged so far."""
    with contextlib.suppress(TimeoutError):
        poll_until(lambda: (w.proc is not None and w.proc.poll() is not None) or _in_flight(r, w.hostname) == 0,
                   timeout_s, f"{w.hostname} to finish what it held")


def _worker_fate(w: WorkerProcess, spare: WorkerProcess | None) -> str:
    if spare is None:
        return "the worker reconnected by itself"
    reason = next((line.split("Unrecoverable error:", 1)[1].strip() for line in w.log_tail(200_000).splitlines()
                   if "Unrecoverable error:" in line), "no reason logged")
    return (f"**the worker exited** (code {w.proc.returncode if w.proc else None}, Celery: Unrecoverable error: "
            f"{reason}); a replacement worker was started (as a supervisor would) and served every accepted request")


# -- worker faults --------------------------------------------------------------------------------
@pytest.mark.parametrize("signal_name", ["SIGKILL", "SIGTERM"])
def test_worker_killed_under_load_loses_nothing(fleet: Fleet, signal_name: str) -> None:
    cfg = _cfg(fleet)
    w1, w2 = fleet.worker(cfg, wait=False), fleet.worker(cfg, wait=False)  # both start at once
    w1.wait_ready(120)
    w2.wait_ready(120)
    client = fleet.client(cfg)
    r = redis.Redis.from_url(fleet.redis_url)
    load = Load(client, RATE).start()
    wait_until(lambda: _accepted_at_least(load, 40) and _in_flight(r, w1.hostname) > 0, 20, "load on worker 1")
    held = _in_flight(r, w1.hostname)
    t_fault = time.monotonic()
    if signal_name == "SIGKILL":
        w1.kill()
    else:
        stopper = threading.Thread(target=w1.stop, kwargs={"timeout_s": 20})
        stopper.start()
    recover_s = probe_recovery(client, t_fault)
    wait_until(lambda: _accepted_at_least(load, 160), 20, "load after the fault")
    load.stop()
    load_end = time.monotonic()
    if signal_name == "SIGTERM":
        stopper.join(25)
        assert w1.proc is not None and w1.proc.returncode == 0, w1.log_tail()
    completed, lost, errors = settle(client, load.ids, 3 * VISIBILITY_S + 15)
    all_done_s = time.monotonic() - load_end
    dup = succeeded_twice([w1, w2], load.ids)
    record(f"worker-{signal_name.lower()}", FaultRecord(
        fault=f"worker {signal_name} under load",
        injected=f"{signal_name} to one of two demo-lm workers (concurrency 8, 0.5 s batch window) while it held "
                 f"{held} requests",
        load=f"{RATE:g} req/s, 1 producer thread", accepted=len(load.accepted), completed=completed,
        lost=len(lost), duplicated=len(dup), refused=sum(load.refused.values()), recover_s=round(recover_s, 2),
        failed=dict(errors), order=1 if signal_name == "SIGKILL" else 2,
        notes=f"every accepted request done {all_done_s:.1f} s after the load stopped ({load_end - t_fault:.1f} s "
              f"after the {signal_name}; visibility timeout {VISIBILITY_S} s)"
              + ("; the dying worker finished its held requests (exit 0)" if signal_name == "SIGTERM" else ""),
    ))
    assert not lost and not errors, (lost, errors)
    audit(client, load.ids).raise_if_broken()
    assert w2.proc is not None and w2.proc.poll() is None


# -- Redis faults ---------------------------------------------------------------------------------
@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGKILL"])
def test_redis_restart_with_aof_under_load(tmp_path: Path, model_dir: Path, signal_name: str) -> None:
    server = EmbeddedRedis(appendonly=True, data_dir=tmp_path / "redis")
    (tmp_path / "redis").mkdir()
    server.start()
    fleet = Fleet(tmp_path, model_dir, server.url)
    try:
        cfg = _cfg(fleet)
        w = fleet.worker(cfg)
        client = fleet.client(cfg)
        load = Load(client, RATE).start()
        wait_until(lambda: _accepted_at_least(load, 40), 20, "load before the restart")
        if signal_name == "SIGTERM":
            server.stop()  # Redis writes its AOF out and exits
        else:
            server.kill()  # what Redis wrote to the AOF is in the page cache: a process crash keeps it
        down_at = time.monotonic()
        time.sleep(2.0)
        server.start()
        t_back = time.monotonic()
        recover_s, spare = _recover_or_replace(fleet, cfg, client, w, t_back)
        wait_until(lambda: _accepted_at_least(load, 140), 20, "load after the restart")
        load.stop()
        completed, lost, errors = settle(client, load.ids, 3 * VISIBILITY_S + 15)
        dup = succeeded_twice([w] + ([spare] if spare else []), load.ids)
        record(f"redis-restart-aof-{signal_name.lower()}", FaultRecord(
            fault=f"Redis restart (AOF, {signal_name}) under load",
            injected=f"{signal_name} to redis-server (appendonly yes, appendfsync everysec), down "
                     f"{t_back - down_at:.1f} s, started again on the same port and data folder",
            load=f"{RATE:g} req/s, 1 producer thread; 1 demo-lm worker (0.5 s batch window)",
            accepted=len(load.accepted), completed=completed, lost=len(lost), duplicated=len(dup),
            refused=sum(load.refused.values()), recover_s=None if recover_s is None else round(recover_s, 2),
            failed=dict(errors), order=3,
            notes=_worker_fate(w, spare) + "; refused = submits that raised while Redis was down: "
            + (", ".join(f"{k} {v}" for k, v in load.refused.items()) or "none"),
        ))
        assert not lost and not errors, (lost, errors)
        audit(client, load.ids).raise_if_broken()
        # an ack racing the reconnect used to kill it (kombu AttributeError in _connparams, 1 run in 5);
        # broker/poison.py makes a closed channel a lost connection, which Celery reconnects on
        assert spare is None, "the worker exited when Redis went away:\n" + w.log_tail()
    finally:
        fleet.close()
        server.stop()
        shutil.rmtree(tmp_path / "redis", ignore_errors=True)


def test_stalled_redis_loses_nothing_and_worker_recovers(fleet: Fleet, redis_server: EmbeddedRedis) -> None:
    stall_s = 12.0  # longer than every socket timeout of the fleet (producer 2 s, worker runtime 10 s)
    cfg = _cfg(fleet)
    w = fleet.worker(cfg)
    client = fleet.client(cfg)
    load = Load(client, 10.0).start()
    wait_until(lambda: _accepted_at_least(load, 30), 20, "load before the stall")
    redis_server.pause()
    time.sleep(stall_s)
    redis_server.resume()
    t_back = time.monotonic()
    recover_s, spare = _recover_or_replace(fleet, cfg, client, w, t_back)
    n = len(load.accepted)
    wait_until(lambda: _accepted_at_least(load, n + 40), 20, "load after the stall")
    load.stop()
    completed, lost, errors = settle(client, load.ids, 3 * VISIBILITY_S + 15)
    dup = succeeded_twice([w] + ([spare] if spare else []), load.ids)
    record("redis-stalled", FaultRecord(
        fault="Redis stalled", injected=f"SIGSTOP to redis-server for {stall_s:g} s (socket timeouts: producer 2 s, "
                                        "worker 10 s), then SIGCONT",
        load="10 req/s, 1 producer thread; 1 demo-lm worker (0.5 s batch window)", accepted=len(load.accepted),
        completed=completed, lost=len(lost), duplicated=len(dup), refused=sum(load.refused.values()),
        recover_s=None if recover_s is None else round(recover_s, 2), failed=dict(errors), order=4,
        notes=_worker_fate(w, spare) + "; refused = submits that timed out during the stall: "
        + (", ".join(f"{k} {v}" for k, v in load.refused.items()) or "none"),
    ))
    assert not lost and not errors, (lost, errors)
    audit(client, load.ids).raise_if_broken()
    assert spare is None, "the worker exited during the Redis stall:\n" + w.log_tail()


def _mount_tmpfs(path: Path, size: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs for the full-disk test: {out.stderr.strip()}")


def test_full_disk_for_aof(tmp_path: Path, model_dir: Path) -> None:
    if not IS_ROOT:
        pytest.skip("needs root to mount a 4 MiB tmpfs")
    disk = tmp_path / "aofdisk"
    _mount_tmpfs(disk, "4m")
    server = EmbeddedRedis(appendonly=True, data_dir=disk)
    fleet: Fleet | None = None
    try:
        server.start()
        fleet = Fleet(tmp_path, model_dir, server.url)
        cfg = _cfg(fleet)
        w = fleet.worker(cfg)
        client = fleet.client(cfg)
        load = Load(client, RATE).start()
        wait_until(lambda: _accepted_at_least(load, 20), 20, "load before the disk fills")
        filler = disk / "filler"
        free = shutil.disk_usage(disk).free
        with open(filler, "wb") as f:  # leave ~64 KiB: the AOF fills it within a few seconds
            f.write(b"\0" * max(0, free - 64 * 1024))
        wait_until(lambda: sum(load.refused.values()) > 0, 20, "the full disk to refuse a write")
        full_at = time.monotonic()
        time.sleep(3.0)
        filler.unlink()
        t_back = time.monotonic()
        recover_s, spare = _recover_or_replace(fleet, cfg, client, w, t_back)
        n = len(load.accepted)
        wait_until(lambda: _accepted_at_least(load, n + 40), 20, "load after the disk was freed")
        load.stop()
        completed, lost, errors = settle(client, load.ids, 3 * VISIBILITY_S + 15)
        dup = succeeded_twice([w] + ([spare] if spare else []), load.ids)
        first_refusal = load.refused_at[0]
        lost_when = [round(load.accepted_at(rid) - first_refusal, 2) for rid in lost]
        record("aof-disk-full", FaultRecord(
            fault="full disk for the AOF", injected=f"redis-server's folder on a 4 MiB tmpfs filled with a file "
                                                    f"({t_back - full_at:.1f} s full), then the file removed",
            load=f"{RATE:g} req/s, 1 producer thread; 1 demo-lm worker (0.5 s batch window)",
            accepted=len(load.accepted), completed=completed, lost=len(lost), duplicated=len(dup),
            refused=sum(load.refused.values()), recover_s=None if recover_s is None else round(recover_s, 2),
            failed=dict(errors), order=5,
            notes=_worker_fate(w, spare).replace(" and served every accepted request", "")
            + "; Redis refuses writes (MISCONF) while its AOF cannot be written; refused: "
            + (", ".join(f"{k} {v}" for k, v in load.refused.items()) or "none")
            + (f"; lost were accepted {lost_when} s from the first refused write" if lost else ""),
        ))
        # MISCONF is a write refusal the worker rides out (broker/redis_refusals.py): it reconnects with
        # backoff, holds a message Redis refused to record, retries result writes; nothing is lost
        assert spare is None, "the worker exited on MISCONF:\n" + w.log_tail()
        assert not lost, f"lost {lost}, accepted {lost_when} s from the first refused write"
        audit(client, load.ids).raise_if_broken()
    finally:
        if fleet is not None:
            fleet.close()
        server.stop()
        subprocess.run(["umount", "-l", str(disk)], check=False)


# -- network cut ----------------------------------------------------------------------------------
class _BoundRedis(EmbeddedRedis):
    """An EmbeddedRedis that also listens on ``extra_bind`` (the host end of a veth pair)."""

    def __init__(self, extra_bind: str, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.extra_bind = extra_bind

    def _args(self) -> list[str]:
        args = super()._args()
        args.insert(args.index("--bind") + 2, self.extra_bind)
        args[args.index("--protected-mode") + 1] = "no"  # no password: protected mode admits loopback only
        return args


class _Netns:
    """A network namespace joined to the host by a veth pair on a private /30 (10.213.N.0/30)."""

    def __init__(self) -> None:
        n = os.getpid() % 200 + 20
        self.name = f"fleetfault{os.getpid()}"
        self.host_if, self.ns_if = f"vfh{os.getpid() % 100000}", f"vfn{os.getpid() % 100000}"
        self.host_ip, self.ns_ip = f"10.213.{n}.1", f"10.213.{n}.2"

    def _ip(self, *args: str, ns: bool = False) -> None:
        cmd = (["ip", "netns", "exec", self.name, "ip"] if ns else ["ip"]) + list(args)
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {out.stderr.strip()}")

    def create(self) -> None:
        self._ip("netns", "add", self.name)
        self._ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
        self._ip("link", "set", self.ns_if, "netns", self.name)
        self._ip("addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
        self._ip("link", "set", self.host_if, "up")
        self._ip("addr", "add", f"{self.ns_ip}/30", "dev", self.ns_if, ns=True)
        self._ip("link", "set", self.ns_if, "up", ns=True)
        self._ip("link", "set", "lo", "up", ns=True)

    def link(self, up: bool) -> None:
        self._ip("link", "set", self.host_if, "up" if up else "down")

    def delete(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True, check=False)


@pytest.fixture
def netns() -> Iterator[_Netns]:
    if not IS_ROOT or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to make a network namespace and a veth pair")
    ns = _Netns()
    try:
        ns.create()
    except RuntimeError as exc:
        ns.delete()
        pytest.skip(f"cannot make a network namespace here: {exc}")
    try:
        yield ns
    finally:
        ns.delete()


def test_network_cut_between_worker_and_redis(tmp_path: Path, model_dir: Path, netns: _Netns) -> None:
    server = _BoundRedis(netns.host_ip).start()
    fleet = Fleet(tmp_path, model_dir, server.url)
    try:
        # worker A, inside the namespace, holds what it takes for 10 s (the longest batch window)
        holding = fleet.config(visibility_timeout_s=VISIBILITY_S, worker={"heartbeat_s": 0.5},
                               models={"demo-lm": {"batching": {"max_wait_ms": 10_000, "close_when_idle": False}}})
        normal = fleet.config(visibility_timeout_s=VISIBILITY_S, worker={"heartbeat_s": 0.5})
        ns_url = f"redis://{netns.host_ip}:{server.port}/0"
        a = WorkerProcess(model="demo-lm", queue=fleet.settings(holding).queue_for("demo-lm"), redis_url=ns_url,
                          concurrency=8, hostname="a-netns@test", env={"FLEET_CONFIG": str(holding)},
                          log_path=tmp_path / "worker-a.log")
        a.cmd[:0] = ["ip", "netns", "exec", netns.name]
        fleet.workers.append(a.start())
        a.wait_ready(120)
        client = fleet.client(normal)
        held = [client.submit("demo-lm", [5 + i] * (3 + i)) for i in range(5)]
        r = server.client()
        wait_until(lambda: _in_flight(r, a.hostname) >= 5, 30, "worker A to take the 5 requests")
        netns.link(up=False)
        t_cut = time.monotonic()
        b = fleet.worker(normal, wait=False, hostname="b-host@test")
        load = Load(client, 10.0).start()
        held_res = client.wait(held, 3 * VISIBILITY_S + 30)
        held_done_s = time.monotonic() - t_cut
        load.stop()
        netns.link(up=True)
        t_back = time.monotonic()
        recover_s = probe_recovery(client, t_back)
        ids = held + load.ids
        completed, lost, errors = settle(client, ids, 3 * VISIBILITY_S + 15)
        _wait_idle_or_gone(r, a)  # let A, reconnected, finish whatever it still held
        dup = succeeded_twice([a, b], ids)
        by_b = sum(1 for res in held_res if isinstance(res, InferenceResult) and res.timings.worker == b.hostname)
        record("network-cut", FaultRecord(
            fault="network cut worker ↔ Redis",
            injected="worker A in its own network namespace, Redis reached over a veth pair (10.213.x.0/30); "
                     "the host end set down while A held 5 requests (10 s batch window), up again after they were "
                     "served elsewhere",
            load="5 held + 10 req/s during the cut; worker B (host) started at the cut", accepted=len(ids),
            completed=completed, lost=len(lost), duplicated=len(dup), refused=sum(load.refused.values()),
            recover_s=round(recover_s, 2), failed=dict(errors), order=6,
            notes=f"A's 5 held requests were redelivered after the visibility timeout ({VISIBILITY_S} s) and done by B "
                  f"{held_done_s:.1f} s after the cut ({by_b}/5 by B); recover = link up → a probe served",
        ))
        assert not lost and not errors, (lost, errors)
        audit(client, ids).raise_if_broken()
        assert by_b == 5, held_res
    finally:
        fleet.close()
        server.stop()


# -- memory limit ---------------------------------------------------------------------------------
def test_worker_memory_limit(tmp_path: Path, fleet: Fleet) -> None:
    if not IS_ROOT:
        pytest.skip("needs root to set RLIMIT_AS on the worker process")
    big_tokens = 6000
    build_encoder(tmp_path / "big", name="big-encoder", max_positions=big_tokens + 16)
    model = {"path": str(tmp_path / "big" / "big-encoder" / "big-encoder-1.0.0.onnx"),
             "batching": {"max_batch_size": 4, "max_wait_ms": 2.0, "max_batch_tokens": 4 * big_tokens},
             "limits": {"max_input_tokens": big_tokens},
             # no start-up warm-up at the extreme shapes: it would grow ORT's arena to the big request's size
             "engine": {"intra_op_threads": 1, "warmup": False}}
    cfg = fleet.config(visibility_timeout_s=VISIBILITY_S, worker={"heartbeat_s": 0.5, "max_deliveries": 2},
                       models={"big-encoder": model})
    w = fleet.worker(cfg, model="big-encoder", concurrency=4)
    assert w.proc is not None
    client = fleet.client(cfg)
    # warm up first: every pool thread started (their stacks mapped), ORT's arena grown for small batches
    warm = client.submit_many("big-encoder", [[5 + i] * (4 + i) for i in range(16)], progress=False, threads=4)
    assert all(isinstance(x, InferenceResult) for x in client.wait(warm, 30))
    proc = psutil.Process(w.proc.pid)
    limit = proc.memory_info().vms + HEADROOM_MIB * 1024 * 1024
    proc.rlimit(psutil.RLIMIT_AS, (limit, limit))
    big = client.submit("big-encoder", [7] * big_tokens)
    big_res = client.wait([big], 3 * VISIBILITY_S + 20)[0]
    t_fault = time.monotonic()
    alive = w.proc.poll() is None
    spare: WorkerProcess | None = None
    if not alive:
        spare = fleet.worker(cfg, model="big-encoder", concurrency=4)
    recover_s = probe_recovery_model(client, "big-encoder", t_fault)
    small = [client.submit("big-encoder", [5 + i % 50] * (4 + i)) for i in range(40)]
    completed, lost, errors = settle(client, small, 30)
    dead = DeadLetterStore(redis.Redis.from_url(fleet.redis_url)).entries()
    outcome = "completed" if isinstance(big_res, InferenceResult) else type(big_res).__name__
    record("memory-limit", FaultRecord(
        fault="worker at its memory limit",
        injected=f"RLIMIT_AS = the worker's VMS + {HEADROOM_MIB} MiB after a warm-up (psutil.rlimit), then one "
                 f"{big_tokens}-token encoder request that needs ~1.2 GiB",
        load="1 oversized request, then 40 small ones", accepted=1 + len(small), completed=completed
        + (outcome == "completed"), lost=len(lost) + (outcome == "ResultTimeout"), duplicated=0, refused=0,
        recover_s=round(recover_s, 2), failed=dict(errors) | ({outcome: 1} if outcome != "completed" else {}),
        order=7,
        notes=f"the oversized request ended as {outcome} ({str(big_res)[:90]!r}); the worker "
              + ("kept serving (ONNX Runtime's allocation failed inside the request)" if alive
                 else f"died (exit {w.proc.returncode}); a spare worker took over")
              + f"; dead-letter entries: {len(dead)}",
    ))
    assert outcome != "ResultTimeout", "the oversized request was neither served nor failed nor dead-lettered"
    assert not lost and not errors, (lost, errors)
    audit(client, [big, *small], models=["big-encoder"]).raise_if_broken()
    assert alive or spare is not None


def probe_recovery_model(client: object, model: str, since: float, timeout_s: float = 60.0) -> float:
    """:func:`probe_recovery` for another model than demo-lm."""
    from producer.client import FleetClient

    assert isinstance(client, FleetClient)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rid = client.submit(model, [7, 8, 9])
        if isinstance(client.wait([rid], max(0.1, deadline - time.monotonic()))[0], InferenceResult):
            return time.monotonic() - since
    raise TimeoutError(f"{model} did not serve a probe within {timeout_s} s")


# -- soak smoke (the 30-minute soak itself is `fleet soak`, never in CI) -----------------------------
def test_soak_smoke(tmp_path: Path, model_dir: Path) -> None:
    from bench.soak import SoakOptions, run_soak

    out = tmp_path / "soak.md"
    run = run_soak(SoakOptions(minutes=20 / 60, out=out, sample_every_s=5.0, drain_timeout_s=30.0,
                               work_dir=tmp_path / "soak", model_dir=model_dir))
    assert not run.lost, run.lost
    assert run.ledger["accepted"] > 0 and not run.ledger["violations_by_kind"], run.ledger
    assert not run.leftover_keys, run.leftover_keys
    assert len(run.samples) >= 3
    assert any(k.endswith(": completed") for k in run.outcomes), run.outcomes
    assert "## Memory: plateau" in out.read_text()
    assert (tmp_path / "img" / "soak-0.333333min.png").exists()
