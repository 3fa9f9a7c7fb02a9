"""Helpers of the fault matrix (tests/integration/test_faults.py): steady load, settling, figures.

:class:`Load` submits at a fixed rate from a thread and remembers what was accepted and refused;
:func:`settle` waits for every accepted request; :func:`succeeded_twice` reads the workers' logs for
requests computed more than once; :func:`record` writes one row of the matrix to
``var/reliability/<fault>.json`` (``bench.fault_table`` renders them into docs/reliability.md).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from producer.client import FleetClient
from protocol.errors import FleetError, ResultTimeout
from protocol.messages import InferenceResult
from tools.ledger import Ledger, LedgerReport
from tools.processes import WorkerProcess

__all__ = ["FaultRecord", "Load", "audit", "probe_recovery", "record", "settle", "succeeded_twice"]

ROOT = Path(__file__).resolve().parents[2]
RECORD_DIR = ROOT / "var" / "reliability"
_SUCCEEDED = re.compile(r"Task fleet\.infer\[([0-9a-f]+)\] succeeded")


@dataclass
class Load:
    """Submits ``rate_per_s`` demo-lm requests per second from a thread until :meth:`stop`."""

    client: FleetClient
    rate_per_s: float = 20.0
    model: str = "demo-lm"
    accepted: list[tuple[str, float]] = field(default_factory=list)
    refused: Counter[str] = field(default_factory=Counter)
    refused_at: list[float] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Load:
        self._thread = threading.Thread(target=self._run, name="fault-load", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        period = 1.0 / self.rate_per_s
        next_t = time.monotonic()
        i = 0
        while not self._stop.is_set():
            i += 1
            try:
                rid = self.client.submit(self.model, [3 + i % 200] * (3 + i % 20))
                self.accepted.append((rid, time.monotonic()))
            except Exception as exc:
                self.refused[type(exc).__name__] += 1
                self.refused_at.append(time.monotonic())
            next_t = max(next_t + period, time.monotonic() - 1.0)
            self._stop.wait(max(0.0, next_t - time.monotonic()))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def accepted_at(self, request_id: str) -> float:
        """When ``request_id`` was accepted (monotonic s)."""
        return next(t for rid, t in self.accepted if rid == request_id)

    @property
    def ids(self) -> list[str]:
        return [rid for rid, _ in self.accepted]


def settle(client: FleetClient, ids: Sequence[str], timeout_s: float) -> tuple[int, list[str], Counter[str]]:
    """Wait for ``ids``: (completed, lost IDs, errors by class name). Lost = no result and no error in time."""
    completed, lost, errors = 0, [], Counter[str]()
    for rid, res in zip(ids, client.wait(list(ids), timeout_s), strict=True):
        if isinstance(res, InferenceResult):
            completed += 1
        elif isinstance(res, ResultTimeout):
            lost.append(rid)
        else:
            errors[type(res).__name__] += 1
    return completed, lost, errors


def audit(client: FleetClient, ids: Sequence[str], models: Sequence[str] = ("demo-lm",),
          timeout_s: float = 30.0) -> LedgerReport:
    """The ledger's verdict on a run (:mod:`tools.ledger`): every accepted ID terminal, nothing left queued,
    unacked or held; waits up to ``timeout_s`` for acks and heartbeats to catch up with the results."""
    ledger = Ledger(client.redis, queues=[client.settings.queue_for(m) for m in models])
    for rid in ids:
        ledger.accepted(rid)
    return ledger.check_settled(timeout_s)


def probe_recovery(client: FleetClient, since: float, timeout_s: float = 60.0) -> float:
    """Seconds from ``since`` (monotonic) until a request submitted now is accepted *and* completed.

    Raises:
        TimeoutError: no probe completed within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            rid = client.submit("demo-lm", [7, 8, 9])
        except Exception:
            time.sleep(0.1)
            continue
        res = client.wait([rid], max(0.1, deadline - time.monotonic()))[0]
        if isinstance(res, InferenceResult):
            return time.monotonic() - since
        if not isinstance(res, (ResultTimeout, FleetError)):
            break
    raise TimeoutError(f"the fleet did not serve a probe within {timeout_s} s")


def succeeded_twice(workers: Sequence[WorkerProcess], ids: Sequence[str]) -> list[str]:
    """IDs among ``ids`` whose ``succeeded`` line appears more than once in the workers' logs (computed twice)."""
    seen: Counter[str] = Counter()
    for w in workers:
        if w.log_path and w.log_path.exists():
            seen.update(_SUCCEEDED.findall(w.log_path.read_text(errors="replace")))
    wanted = set(ids)
    return sorted(rid for rid, n in seen.items() if n > 1 and rid in wanted)


@dataclass
class FaultRecord:
    """One row of the fault matrix."""

    fault: str
    injected: str
    load: str
    accepted: int
    completed: int
    lost: int
    duplicated: int
    refused: int
    recover_s: float | None
    failed: dict[str, int] = field(default_factory=dict)
    notes: str = ""
    order: int = 0


def record(name: str, rec: FaultRecord) -> None:
    """Write ``rec`` to ``var/reliability/<name>.json`` and print it (``pytest -s``)."""
    RECORD_DIR.mkdir(parents=True, exist_ok=True)
    doc = asdict(rec) | {"recorded_at_unix_s": time.time()}
    (RECORD_DIR / f"{name}.json").write_text(json.dumps(doc, indent=1))
    print(f"\n[fault] {name}: {json.dumps(doc)}")
