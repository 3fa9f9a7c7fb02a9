"""``fleet soak``: an embedded fleet under bounded mixed traffic for N minutes, read every 10 s.

The fleet: a private ``redis-server`` (:mod:`tools.redis_server`), one worker for ``demo-lm`` and one
for ``demo-encoder`` (real Celery threads-pool processes), and the HTTP gateway (``fleet api``). The
driver sends ``rate_per_s`` requests per second, drawn from a fixed mix (:data:`MIX`): good requests
to each model, invalid ones (refused at submit), requests cancelled right after submit, requests
with a deadline too short to meet, bulk chunks, gateway requests (good and invalid), and short
generations. Every ``sample_every_s`` it reads each process's RSS and open fds, Redis ``used_memory``
and keys by prefix, and the outcomes so far (:class:`bench.soak_report.Sample`). At the end it stops
the traffic, waits for every accepted request, lists Redis keys left without a TTL, and writes the
report (:func:`bench.soak_report.render_markdown`) and its plot.

Not in CI: a 30-minute run is a measurement. ``tests/integration/test_faults.py`` has a 20-second
smoke run of the same code.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import redis
import yaml

from bench.soak_report import Sample, SoakRun, key_prefix, render_markdown, render_plot
from producer.client import FleetClient
from protocol.errors import FleetError, ResultTimeout
from protocol.messages import InferenceResult
from protocol.settings import load_settings
from tools.ledger import Ledger
from tools.processes import WorkerProcess, die_with_parent
from tools.redis_server import EmbeddedRedis, free_port

__all__ = ["MIX", "SoakOptions", "run_soak"]

API_KEY = "soak-key"
MIX: dict[str, float] = {
    "good-lm": 0.30,
    "good-encoder": 0.15,
    "invalid": 0.08,
    "cancelled": 0.08,
    "expired": 0.08,
    "bulk": 0.04,
    "gateway": 0.17,
    "gateway-invalid": 0.04,
    "generate": 0.06,
}
"""Share of each kind of request in the traffic (a ``bulk`` draw queues a chunk of :data:`BULK_SIZE`)."""
BULK_SIZE = 8


@dataclass(frozen=True)
class SoakOptions:
    """One soak run: its length, rate, where the report goes, and its work folder."""

    minutes: float
    out: Path
    rate_per_s: float = 20.0
    sample_every_s: float = 10.0
    result_ttl_s: int = 300
    """Short, so stored results expire inside the run and Redis can reach its own plateau."""
    drain_timeout_s: float = 90.0
    work_dir: Path = Path("var/soak")
    model_dir: Path | None = None
    """Where demo-lm and demo-encoder are (built there when missing); None = ``work_dir/models``."""
    seed: int = 7


def _config(work: Path, model_dir: Path, redis_url: str, result_ttl_s: int) -> Path:
    model = {"batching": {"max_batch_size": 8, "max_wait_ms": 2.0}, "limits": {"max_input_tokens": 128},
             "engine": {"intra_op_threads": 1}}
    doc: dict[str, Any] = {
        "redis_url": redis_url,
        "result_ttl_s": result_ttl_s,
        "visibility_timeout_s": 120,
        "worker": {"concurrency": 8, "loglevel": "WARNING", "heartbeat_s": 2.0},
        "api": {"api_keys": [API_KEY]},
        "models": {
            "demo-lm": {"path": str(model_dir / "demo-lm" / "demo-lm-1.0.0.onnx"), **model,
                        "limits": {"max_input_tokens": 128, "max_new_tokens": 16}},
            "demo-encoder": {"path": str(model_dir / "demo-encoder" / "demo-encoder-1.0.0.onnx"), **model},
        },
    }
    path = work / "soak.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


class _Fleet:
    """The processes of one soak: Redis, two workers, the gateway."""

    def __init__(self, opts: SoakOptions) -> None:
        from tools.build_encoder import build_encoder
        from tools.build_lm import build_causal_lm

        self.work = opts.work_dir.resolve()
        (self.work / "logs").mkdir(parents=True, exist_ok=True)
        model_dir = (opts.model_dir or self.work / "models").resolve()
        if not (model_dir / "demo-lm" / "demo-lm-1.0.0.onnx").exists():
            build_causal_lm(model_dir)
        if not (model_dir / "demo-encoder" / "demo-encoder-1.0.0.onnx").exists():
            build_encoder(model_dir)
        self.redis = EmbeddedRedis().start()
        self.config = _config(self.work, model_dir, self.redis.url, opts.result_ttl_s)
        self.settings = load_settings(self.config)
        self.workers = {
            f"worker-{m}": WorkerProcess(model=m, queue=self.settings.queue_for(m), redis_url=self.redis.url,
                                         concurrency=8, hostname=f"soak-{m}@localhost",
                                         env={"FLEET_CONFIG": str(self.config)},
                                         log_path=self.work / "logs" / f"worker-{m}.log")
            for m in ("demo-lm", "demo-encoder")
        }
        for w in self.workers.values():
            w.cmd[w.cmd.index("--loglevel") + 1] = "WARNING"  # INFO logs every task twice: a log, not a leak
            w.start()
        self.gateway_port = free_port()
        self._gw_log = open(self.work / "logs" / "gateway.log", "ab")  # noqa: SIM115 - closed in stop()
        self.gateway = subprocess.Popen(
            [sys.executable, "-m", "producer.cli", "api", "--config", str(self.config), "--host", "127.0.0.1",
             "--port", str(self.gateway_port), "--no-access-log", "--log-level", "warning"],
            stdout=self._gw_log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            preexec_fn=die_with_parent,
        )
        for w in self.workers.values():
            w.wait_ready(180)
        self.gateway_url = f"http://127.0.0.1:{self.gateway_port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.gateway_url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.gateway.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gateway did not come up (exit {self.gateway.poll()})")
            time.sleep(0.2)

    def pids(self) -> dict[str, int]:
        out = {"redis-server": self.redis.proc.pid if self.redis.proc else 0, "gateway": self.gateway.pid,
               "driver": os.getpid()}
        out |= {name: w.proc.pid for name, w in self.workers.items() if w.proc}
        return out

    def stop(self) -> None:
        self.gateway.terminate()
        try:
            self.gateway.wait(15)
        except subprocess.TimeoutExpired:
            self.gateway.kill()
        self._gw_log.close()
        for w in self.workers.values():
            w.stop(timeout_s=30)
        self.redis.stop()


class _Driver:
    """Sends the mix, remembers every accepted ID, and collects outcomes."""

    def __init__(self, client: FleetClient, gateway_url: str, seed: int) -> None:
        self.client = client
        self.http = httpx.Client(base_url=gateway_url, headers={"X-API-Key": API_KEY}, timeout=10)
        self.rng = random.Random(seed)
        self.pending: dict[str, str] = {}
        self.ledger = Ledger(client.redis, queues=[client.settings.queue_for(m) for m in ("demo-lm", "demo-encoder")])
        self.outcomes: Counter[str] = Counter()
        self.vocab = 256

    def _ids(self, n_max: int = 40) -> list[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(self.rng.randint(2, n_max))]

    def send_one(self) -> None:
        kind = self.rng.choices(list(MIX), weights=list(MIX.values()))[0]
        try:
            self._send(kind)
        except FleetError as exc:
            self.outcomes[f"{kind}: refused {type(exc).__name__}"] += 1
        except (httpx.HTTPError, redis.RedisError) as exc:
            self.outcomes[f"{kind}: send error {type(exc).__name__}"] += 1

    def _accept(self, request_id: str, kind: str) -> None:
        self.pending[request_id] = kind
        self.ledger.accepted(request_id, streamed=kind == "generate")

    def _send(self, kind: str) -> None:
        c = self.client
        if kind == "good-lm":
            self._accept(c.submit("demo-lm", self._ids()), kind)
        elif kind == "good-encoder":
            self._accept(c.submit("demo-encoder", self._ids()), kind)
        elif kind == "invalid":  # over-long, or a token out of the vocabulary: refused at submit
            bad = [5] * 500 if self.rng.random() < 0.5 else [1_000_000, 4]
            c.submit("demo-lm", bad)
        elif kind == "cancelled":
            rid = c.submit("demo-lm", self._ids())
            c.cancel(rid)
            self._accept(rid, kind)
        elif kind == "expired":
            self._accept(c.submit("demo-lm", self._ids(), deadline_s=0.001), kind)
        elif kind == "bulk":
            for rid in c.submit_bulk("demo-encoder", [self._ids() for _ in range(BULK_SIZE)], chunk_size=BULK_SIZE):
                self._accept(rid, kind)
        elif kind == "gateway":
            model = self.rng.choice(["demo-lm", "demo-encoder"])
            r = self.http.post("/v1/requests", json={"model": model, "input_ids": self._ids()})
            if r.status_code == 202:
                self._accept(r.json()["request_id"], kind)
            else:
                self.outcomes[f"{kind}: HTTP {r.status_code}"] += 1
        elif kind == "gateway-invalid":
            body = self.rng.choice([{"model": "demo-lm", "input_ids": []}, {"model": "nope", "input_ids": [4]},
                                    {"model": "demo-lm", "input_ids": [5] * 500}, {"model": "demo-lm"}])
            r = self.http.post("/v1/requests", json=body)
            self.outcomes[f"{kind}: HTTP {r.status_code}"] += 1
        elif kind == "generate":
            rid = c.submit("demo-lm", self._ids(20), generation={"max_new_tokens": self.rng.randint(2, 12)})
            self._accept(rid, kind)

    def collect(self) -> None:
        """Move finished requests from ``pending`` to ``outcomes`` (one MGET per 1,000 IDs)."""
        ids = list(self.pending)
        if not ids:
            return
        for rid, res in zip(ids, self.client.wait(ids, timeout_s=0), strict=True):
            if isinstance(res, ResultTimeout):
                continue
            kind = self.pending.pop(rid)
            what = "completed" if isinstance(res, InferenceResult) else type(res).__name__
            self.outcomes[f"{kind}: {what}"] += 1

    def close(self) -> None:
        self.http.close()


def _proc_reading(pids: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    rss: dict[str, int] = {}
    fds: dict[str, int] = {}
    for name, pid in pids.items():
        try:
            p = psutil.Process(pid)
            rss[name] = int(p.memory_info().rss)
            fds[name] = int(p.num_fds())
        except psutil.Error:
            continue
    return rss, fds


def _keys_by_prefix(r: redis.Redis[bytes]) -> Counter[str]:
    return Counter(key_prefix(k.decode(errors="replace")) for k in r.scan_iter(count=1000))


def _permanent(key: str, queues: set[str]) -> bool:
    """Keys that live as long as the fleet: queues, kombu's bookkeeping, model cards, the dead-letter list."""
    return (key in queues or key.startswith("_kombu.") or key in ("unacked", "unacked_index")
            or (key.startswith("fleet:model:") and key.endswith(":card")) or key == "fleet:dead-letter")


def _no_ttl_keys(r: redis.Redis[bytes], queues: set[str]) -> tuple[list[str], list[str]]:
    permanent: list[str] = []
    leftover: list[str] = []
    for raw in r.scan_iter(count=1000):
        key = raw.decode(errors="replace")
        if r.ttl(raw) == -1:
            (permanent if _permanent(key, queues) else leftover).append(key)
    return sorted(permanent), sorted(leftover)


def _say(msg: str) -> None:
    print(f"[soak] {msg}", file=sys.stderr, flush=True)


def run_soak(opts: SoakOptions) -> SoakRun:
    """Run the soak and write ``opts.out`` and its plot (``docs/img/soak-*.png`` beside a docs report)."""
    fleet = _Fleet(opts)
    client = FleetClient(fleet.settings)
    driver = _Driver(client, fleet.gateway_url, opts.seed)
    r = fleet.redis.client()
    samples: list[Sample] = []
    notes: list[str] = []
    try:
        pids = fleet.pids()
        _say(f"fleet up: {pids}; {opts.minutes:g} min at {opts.rate_per_s:g} req/s")
        began = time.monotonic()
        end = began + opts.minutes * 60
        next_send, next_sample, next_collect = began, began, began
        period = 1.0 / opts.rate_per_s
        while (now := time.monotonic()) < end:
            if now >= next_sample:
                rss, fds = _proc_reading(pids)
                used = int(r.info("memory")["used_memory"])
                samples.append(Sample(now - began, rss, fds, used, dict(_keys_by_prefix(r)), dict(driver.outcomes)))
                next_sample += opts.sample_every_s
                _say(f"t={now - began:5.0f}s pending={len(driver.pending)} rss="
                     + " ".join(f"{k}:{v >> 20}M" for k, v in rss.items()) + f" redis={used >> 20}M")
            if now >= next_collect:
                driver.collect()
                next_collect += 1.0
            if now >= next_send:
                driver.send_one()
                next_send += period
                if next_send < now - 1.0:  # fell behind by more than a second: do not burst to catch up
                    next_send = now
            time.sleep(max(0.0, min(next_send, next_sample, next_collect) - time.monotonic()))
        for name, w in fleet.workers.items():
            if w.proc is None or w.proc.poll() is not None:
                notes.append(f"{name} exited during the run (code {w.proc.returncode if w.proc else None})")
        drain_end = time.monotonic() + opts.drain_timeout_s
        while driver.pending and time.monotonic() < drain_end:
            driver.collect()
            time.sleep(0.5)
        lost = sorted(driver.pending)
        ledger = driver.ledger.check_settled(opts.drain_timeout_s).as_dict()
        queues = {fleet.settings.queue_for(m) for m in ("demo-lm", "demo-encoder")}
        permanent, leftover = _no_ttl_keys(r, queues)
        run = SoakRun(opts.minutes, opts.rate_per_s, samples, dict(driver.outcomes), lost, leftover, permanent,
                      {name: f"pid {pid}" for name, pid in pids.items()}, notes, ledger)
    finally:
        driver.close()
        client.close()
        r.close()
        fleet.stop()
    _write(run, opts.out)
    return run


def _write(run: SoakRun, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    plot_rel: str | None = None
    if len(run.samples) >= 2:
        img = out.parent / "img" / f"soak-{run.minutes:g}min.png"
        render_plot(run, img)
        plot_rel = os.path.relpath(img, out.parent)
    out.write_text(render_markdown(run, plot_rel))
    out.with_suffix(".json").write_text(json.dumps(asdict(run), indent=1))  # the samples, to re-render or compare
    _say(f"report: {out}")
