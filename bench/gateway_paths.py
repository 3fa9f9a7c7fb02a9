"""The gateway rows: each HTTP route against the Python client, on the same worker, in interleaved rounds.

``fleet bench --only gateway`` starts one worker and one gateway (``fleet api``) per model of the preset
and runs ``callers`` closed-loop callers per row for ``duration_s`` seconds, the rows of a model in turn,
their order reversed every other round:

* ``bench-lm``, one-step requests (top-5 next tokens of a short prompt): ``FleetClient`` (``submit`` +
  ``result(wait=True)``); ``POST /v1/requests`` + ``GET /v1/requests/{id}`` polled (from 2 ms, backing
  off ×1.5 to 20 ms); the same with one long-poll ``GET …?wait_s=30``; ``POST /v1/requests?wait_s=30``
  alone (the result in the submit's answer);
* ``bench-encoder``: ``FleetClient`` embeddings; ``POST /v1/embeddings`` with one input per call.

Then one caller alone sends ``lone`` requests through each row (median latency). The HTTP callers use
the standard library's ``http.client`` on keep-alive connections (no third-party client's overhead in
the figures); every caller's own CPU time (``time.thread_time``) is reported beside the fleet's
processes', since all of them share this machine's cores. Nothing asserts a speed: ``gateway.md``
reports requests/s, the ratio of each route to the client's, latencies and CPU per request.
"""

from __future__ import annotations

import http.client
import json
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench.procs import CpuMeter, FleetConfig, RunningFleet, flush_redis
from bench.redis_cost import GatewayServer
from bench.standalone import preset_model, say, write_page
from producer.client import FleetClient
from protocol.modelcard import load_card
from tools.calibration import synthetic_sequences

__all__ = ["GatewayPlan", "measure_gateway_paths", "render_gateway", "run_gateway_only"]

TERMINAL = {"succeeded", "failed", "expired", "cancelled"}


@dataclass(frozen=True)
class GatewayPlan:
    """Sizes of the gateway rows."""

    callers: int = 16
    duration_s: float = 5.0
    warmup_s: float = 0.5
    """Ramp-up at the start of each row's run, not counted (s)."""
    rounds: int = 3
    prompts: int = 256
    min_tokens: int = 8
    max_tokens: int = 32
    lone: int = 60
    """Requests one caller sends alone through each row, one after the other."""


QUICK = GatewayPlan(callers=4, duration_s=1.0, warmup_s=0.2, rounds=1, prompts=32, lone=10)


class Http:
    """One keep-alive HTTP/1.1 connection to the gateway (the standard library's client)."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=120)

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any], str]:
        """(status, JSON body, Location header or "")."""
        data = json.dumps(body).encode() if body is not None else None
        self.conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        resp = self.conn.getresponse()
        raw = resp.read()
        return resp.status, json.loads(raw) if raw else {}, resp.getheader("Location") or ""

    def close(self) -> None:
        self.conn.close()


One = Callable[[Any, Sequence[int]], None]
"""One request through a path, on a caller's own state (its connection or the shared client); raises on
failure."""


@dataclass(frozen=True)
class Path_:
    """A row: how a caller opens its state, and how it sends one request."""

    label: str
    open: Callable[[], Any]
    one: One
    close: Callable[[Any], None] = lambda _: None


def client_path(client: FleetClient, model: str, kind: str | None) -> Path_:
    """``FleetClient.submit`` + ``result(wait=True)`` (pub/sub wake-up)."""

    def one(_: Any, ids: Sequence[int]) -> None:
        rid = client.submit(model, ids, kind=kind) if kind else client.submit(model, ids)
        client.result(rid, wait=True, timeout_s=120)

    return Path_("FleetClient", lambda: None, one)


def native_path(url: str, model: str, *, long_poll: bool) -> Path_:
    """``POST /v1/requests`` then its ``Location``: polled, or long-polled once (``?wait_s=30``)."""

    def one(h: Http, ids: Sequence[int]) -> None:
        status, _, location = h.call("POST", "/v1/requests", {"model": model, "input_ids": list(ids)})
        if status != 202:
            raise RuntimeError(f"POST /v1/requests answered {status}")
        _await_view(h, location, long_poll)

    label = "POST /v1/requests + long-poll GET (`?wait_s=30`)" if long_poll else "POST /v1/requests + polled GET"
    return Path_(label, lambda: Http(url), one, lambda h: h.close())


def submit_wait_path(url: str, model: str) -> Path_:
    """``POST /v1/requests?wait_s=30``: the result in the submit's own answer (200), one exchange per request."""

    def one(h: Http, ids: Sequence[int]) -> None:
        status, view, location = h.call("POST", "/v1/requests?wait_s=30", {"model": model, "input_ids": list(ids)})
        if status == 202:  # not finished within the wait: long-poll its Location
            _await_view(h, location, True)
        elif status != 200 or view.get("status") != "succeeded":
            raise RuntimeError(f"POST /v1/requests?wait_s=30 answered {status}: {view}")

    return Path_("POST /v1/requests?wait_s=30 (one exchange)", lambda: Http(url), one, lambda h: h.close())


def _await_view(h: Http, location: str, long_poll: bool) -> None:
    """GET ``location`` until the request is terminal: long-polled, or polled from 2 ms backing off ×1.5 to
    20 ms; raises unless it succeeded."""
    wait = 0.002
    while True:
        if long_poll:
            _, view, _ = h.call("GET", location + "?wait_s=30")
        else:
            time.sleep(wait)
            _, view, _ = h.call("GET", location)
            wait = min(0.02, wait * 1.5)
        if view.get("status") in TERMINAL:
            if view["status"] != "succeeded":
                raise RuntimeError(f"request {view.get('request_id')} {view['status']}: {view.get('error')}")
            return


def embeddings_path(url: str, model: str) -> Path_:
    """``POST /v1/embeddings``, one input (token ids) per call."""

    def one(h: Http, ids: Sequence[int]) -> None:
        status, body, _ = h.call("POST", "/v1/embeddings", {"model": model, "input": list(ids)})
        if status != 200 or not body.get("data"):
            raise RuntimeError(f"POST /v1/embeddings answered {status}: {body}")

    return Path_("POST /v1/embeddings (one input per call)", lambda: Http(url), one, lambda h: h.close())


def closed_loop(path: Path_, prompts: Sequence[Sequence[int]], callers: int, duration_s: float,
                warmup_s: float) -> dict[str, Any]:  # fmt: skip
    """``callers`` threads sending through ``path`` for ``duration_s`` s; requests finished inside the
    window after ``warmup_s`` count. Returns req/s, latencies (ms) and the callers' CPU seconds."""
    lock = threading.Lock()
    done: list[tuple[float, float]] = []
    errors: list[str] = []
    cpu = [0.0]
    counter = iter(range(10**9))
    start = time.perf_counter()
    stop_at = start + duration_s

    def caller() -> None:
        state = path.open()
        cpu0 = time.thread_time()
        try:
            while time.perf_counter() < stop_at:
                with lock:
                    n = next(counter)
                t0 = time.perf_counter()
                try:
                    path.one(state, prompts[n % len(prompts)])
                except Exception as exc:  # counted, never raised: the report says how many failed
                    with lock:
                        errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                with lock:
                    done.append((t0, time.perf_counter()))
        finally:
            with lock:
                cpu[0] += time.thread_time() - cpu0
            path.close(state)

    threads = [threading.Thread(target=caller, name=f"bench-caller-{i}") for i in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lo, hi = start + warmup_s, stop_at
    window = [(a, b) for a, b in done if lo <= b <= hi]
    lat = sorted(1000 * (b - a) for a, b in window)
    return {
        "requests": len(done),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "qps": len(window) / (hi - lo),
        "p50_ms": lat[len(lat) // 2] if lat else float("nan"),
        "p99_ms": lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else float("nan"),
        "callers_cpu_s": cpu[0],
    }


def _lone(path: Path_, prompts: Sequence[Sequence[int]], count: int) -> float:
    """Median latency (ms) of ``count`` requests sent one after the other by one caller."""
    state = path.open()
    try:
        path.one(state, prompts[0])  # its connection opened, the path warm
        times = []
        for i in range(count):
            t0 = time.perf_counter()
            path.one(state, prompts[i % len(prompts)])
            times.append(1000 * (time.perf_counter() - t0))
        return statistics.median(times)
    finally:
        path.close(state)


def _grouping(url: str) -> tuple[float, float]:
    """(grouped requests, groups) from the gateway's metrics."""
    h = Http(url)
    try:
        h.conn.request("GET", "/metrics")
        text = h.conn.getresponse().read().decode()
    finally:
        h.close()
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith(("fleet_gateway_grouped_requests_total", "fleet_gateway_submit_groups_total"))}
    return values.get("fleet_gateway_grouped_requests_total", 0.0), values.get("fleet_gateway_submit_groups_total", 0.0)


def _setup_rows(plan: GatewayPlan, kind: str, model: Path, redis_url: str, work_dir: Path,
                say: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    """One model's rows (see the module docstring): its worker, its gateway, interleaved rounds."""
    card = load_card(model)
    prompts = synthetic_sequences(plan.prompts, vocab_size=card.vocab_size, min_tokens=plan.min_tokens,
                                  max_tokens=plan.max_tokens, seed=41)  # fmt: skip
    config = FleetConfig(label=f"gateway-{kind}", model_name=card.name, model_path=model,
                         max_batch_size=min(16, plan.callers), concurrency=plan.callers, celery_loglevel="WARNING",
                         max_new_tokens=16)  # fmt: skip
    fleet = RunningFleet(config, redis_url, work_dir)
    client = fleet.start()
    gateway = GatewayServer(fleet.config_path, work_dir / "logs" / f"gateway-{kind}.log")
    try:
        gateway.wait_ready()
        if kind == "encoder":
            paths = {"client": client_path(client, card.name, "embedding"),
                     "embeddings": embeddings_path(gateway.url, card.name)}  # fmt: skip
        else:
            paths = {"client": client_path(client, card.name, None),
                     "native_poll": native_path(gateway.url, card.name, long_poll=False),
                     "native_wait": native_path(gateway.url, card.name, long_poll=True),
                     "submit_wait": submit_wait_path(gateway.url, card.name)}  # fmt: skip
        pids = {"gateway": gateway.proc.pid, "worker": fleet.pid, "redis": _redis_pid(redis_url)}
        for path in paths.values():  # warm every path (first loads, connections)
            closed_loop(path, prompts, 4, 0.3, 0.0)
        runs: dict[str, list[dict[str, Any]]] = {key: [] for key in paths}
        for r in range(plan.rounds):
            order = list(paths) if r % 2 == 0 else list(reversed(paths))
            for key in order:
                grouped0, groups0 = _grouping(gateway.url)
                meter = CpuMeter(pids)
                run = closed_loop(paths[key], prompts, plan.callers, plan.duration_s, plan.warmup_s)
                run["cpu_s"] = meter.elapsed()
                grouped1, groups1 = _grouping(gateway.url)
                run["grouped"], run["groups"] = grouped1 - grouped0, groups1 - groups0
                runs[key].append(run)
                say(f"gateway {card.name} round {r + 1} {key}: {run['qps']:.0f} req/s, p50 {run['p50_ms']:.1f} ms, "
                    f"{run['errors']} errors")
        lone = {key: _lone(path, prompts, plan.lone) for key, path in paths.items()}
    finally:
        gateway.stop()
        fleet.stop()
        flush_redis(redis_url)
    rows = {}
    for key, path in paths.items():
        rs = runs[key]
        total = sum(r["requests"] for r in rs) or 1
        groups = sum(r["groups"] for r in rs)
        cpu = {name: 1000 * sum(r["cpu_s"][name] for r in rs) / total for name in pids}
        cpu["callers"] = 1000 * sum(r["callers_cpu_s"] for r in rs) / total
        rows[key] = {
            "label": path.label,
            "qps": statistics.median(r["qps"] for r in rs),
            "qps_rounds": [round(r["qps"], 1) for r in rs],
            "p50_ms": statistics.median(r["p50_ms"] for r in rs),
            "p99_ms": statistics.median(r["p99_ms"] for r in rs),
            "errors": sum(r["errors"] for r in rs),
            "first_error": next((r["first_error"] for r in rs if r["first_error"]), None),
            "cpu_ms_per_request": {k: round(v, 3) for k, v in cpu.items()},
            "mean_group": sum(r["grouped"] for r in rs) / groups if groups else None,
            "lone_p50_ms": lone[key],
        }
        if key != "client":
            rows[key]["ratio"] = rows[key]["qps"] / rows["client"]["qps"]
            rows[key]["ratio_rounds"] = [round(a["qps"] / b["qps"], 3) for a, b in zip(rs, runs["client"], strict=True)]
    return {"model": card.name, "rows": rows}


def _redis_pid(url: str) -> int:
    import redis

    client = redis.Redis.from_url(url)
    try:
        return int(client.info("server")["process_id"])
    finally:
        client.close()


def measure_gateway_paths(plan: GatewayPlan, models: dict[str, Path], redis_url: str, work_dir: Path,
                          say: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    """Every model's rows; ``models``: ``{"lm": path, "encoder": path}``."""
    return {"plan": asdict(plan),
            "setups": {kind: _setup_rows(plan, kind, path, redis_url, work_dir, say) for kind, path in models.items()}}


def render_gateway(results: dict[str, Any]) -> str:
    """The Markdown page of a :func:`measure_gateway_paths` result (with its ``meta``)."""
    plan, meta = results["plan"], results.get("meta", {})
    lines = [
        "# The gateway against the Python client",
        "",
        f"From one `{meta.get('command', 'fleet bench --only gateway')}` run at commit `{meta.get('commit', '?')}`"
        f"{' (uncommitted changes)' if meta.get('dirty') else ''}, {meta.get('machine', '')}, "
        f"{meta.get('duration_s', 0):.0f} s. {plan['callers']} closed-loop callers per row, "
        f"{plan['duration_s']:g} s per row and round, {plan['rounds']} interleaved rounds (medians; the order "
        f"reversed every other round), prompts of {plan['min_tokens']}–{plan['max_tokens']} tokens; one worker "
        "(C = callers, `max_batch_size` 16) and one gateway per model, Redis, the callers and every process "
        "on the same cores. HTTP callers use the standard library's `http.client` with keep-alive.",
        "",
        "| model | path | req/s | × FleetClient (per round) | p50 ms | p99 ms | lone request p50 ms | "
        "requests per grouped submit | CPU-ms per request: callers / gateway / worker / Redis |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for setup in results["setups"].values():
        for key, row in setup["rows"].items():
            ratio = (f"**{row['ratio']:.2f}** ({', '.join(f'{x:.2f}' for x in row['ratio_rounds'])})"
                     if "ratio" in row else "1")  # fmt: skip
            cpu = row["cpu_ms_per_request"]
            group = f"{row['mean_group']:.1f}" if row.get("mean_group") else "–"
            gw = f"{cpu['gateway']:.2f}" if key != "client" else "–"
            lines.append(f"| `{setup['model']}` | {row['label']} | {row['qps']:.0f} | {ratio} | {row['p50_ms']:.1f} | "
                         f"{row['p99_ms']:.1f} | {row['lone_p50_ms']:.2f} | {group} | {cpu['callers']:.2f} / {gw} / "
                         f"{cpu['worker']:.2f} / {cpu['redis']:.2f} |")
            if row["errors"]:
                lines.append(f"| | ({row['errors']} failed: {row['first_error']}) | | | | | | | |")
    lines += [
        "",
        "The FleetClient's caller CPU is the client library itself (it builds, queues and waits in the caller's "
        "thread); an HTTP row's is the HTTP client only, the gateway doing that work. Requests per grouped "
        "submit: the gateway's `fleet_gateway_grouped_requests_total` ÷ `fleet_gateway_submit_groups_total` "
        "during the row (one Redis step and one `fleet.infer_bulk` message per group; `api.group_submits`).",
        "",
        "How it is measured: `bench/gateway_paths.py`.",
        "",
    ]
    return "\n".join(lines)


def run_gateway_only(quick: bool, preset: str, out_dir: Path, work_dir: Path, command: str,
                     machine: Callable[[], dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    """``fleet bench --only gateway``: build the preset's LM and encoder if needed, run the rows, write
    ``gateway.md`` and ``gateway.json`` in ``out_dir``."""
    from tools.redis_server import EmbeddedRedis

    models = {kind: preset_model(preset, kind, work_dir) for kind in ("lm", "encoder")}
    facts, started = machine(), time.time()
    with EmbeddedRedis() as redis:
        results = measure_gateway_paths(QUICK if quick else GatewayPlan(), models, redis.url, work_dir, say)
    return write_page("gateway", results, render_gateway, out_dir, command=command, facts=facts, started_unix_s=started)
