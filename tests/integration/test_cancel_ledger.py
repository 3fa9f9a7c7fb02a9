"""The cancel ledger: requests of every kind (one-step, bulk, generations) cancelled at random moments while a
reader polls every ID. Each ID reaches one terminal state and keeps it (real redis-server, real worker, real
ONNX Runtime); a request never cancelled never reads ``cancelled``; what ``status`` last said is what
``result`` gives.

The moments are the schedule's (a seeded shuffle of cancels between submits and reads), not the clock's: which
requests a worker holds when each cancel lands varies with the machine's load, and every interleaving must keep
the ledger. ``test_cancel_after_batch`` holds the one interleaving that broke it (a cancel between a batch's run
and its result's store) open on purpose.
"""

from __future__ import annotations

import itertools
import random
import threading
from collections import defaultdict

from producer.client import FleetClient, RequestStatus
from protocol.errors import FleetError, RequestCancelled
from protocol.messages import InferenceResult
from tests.integration.fleet_fixtures import Fleet
from tools.processes import poll_until

TERMINAL = {RequestStatus.SUCCEEDED, RequestStatus.FAILED, RequestStatus.CANCELLED, RequestStatus.EXPIRED}


def _plan(rng: random.Random) -> list[tuple[str, int]]:
    """What to submit, in a seeded order: ``(kind, n)``; a bulk entry is one message of 10 requests."""
    plan = [("infer", n) for n in range(30)] + [("bulk", n) for n in range(2)] + [("generate", n) for n in range(12)]
    rng.shuffle(plan)
    return plan


def _submit(client: FleetClient, kind: str, n: int) -> list[str]:
    if kind == "bulk":
        return client.submit_bulk("demo-lm", [[8, 9, (n * 10 + k) % 5 + 1] for k in range(10)], chunk_size=10)
    if kind == "generate":
        return [client.submit("demo-lm", text=f"turn {n}", generation={"max_new_tokens": 12})]
    return [client.submit("demo-lm", [5 + n % 7, 6, 7])]


def test_every_request_keeps_its_one_terminal_state_under_random_cancels(fleet: Fleet) -> None:
    cfg = fleet.config(models={"demo-lm": {"batching": {"max_wait_ms": 40.0}}})
    fleet.worker(cfg)
    client = fleet.client(cfg)
    rng = random.Random(20261207)
    ids: list[str] = []
    doomed: set[str] = set()
    seen: dict[str, list[RequestStatus]] = defaultdict(list)
    answers: dict[str, bool] = {}
    stop = threading.Event()

    def read_all() -> None:
        while not stop.is_set():
            for rid in list(ids):
                seen[rid].append(client.status(rid))

    reader = threading.Thread(target=read_all, daemon=True)
    reader.start()
    try:
        for kind, n in _plan(rng):  # submits, each followed by cancels of requests submitted so far, at random
            ids.extend(_submit(client, kind, n))
            while rng.random() < 0.5 and len(doomed) < len(ids) // 2:
                rid = rng.choice([i for i in ids if i not in doomed])
                doomed.add(rid)
                answers[rid] = client.cancel(rid)
                if rng.random() < 0.3:
                    seen[rid].append(client.status(rid))  # read right after the cancel, too
        poll_until(lambda: all(seen[rid] and seen[rid][-1] in TERMINAL for rid in ids), 300,
                   "every request to reach a terminal state")  # fmt: skip
    finally:
        stop.set()
        reader.join(60)

    flips = {rid: [s.value for s in states] for rid, states in seen.items()
             if len({s for s in states if s in TERMINAL}) > 1
             or any(a in TERMINAL and b != a for a, b in itertools.pairwise(states))}  # fmt: skip
    outcomes: dict[str, str] = {}
    for rid in ids:
        try:
            outcome = client.result(rid, wait=True, timeout_s=60)
            outcomes[rid] = "succeeded" if isinstance(outcome, InferenceResult) else "none"
        except RequestCancelled:
            outcomes[rid] = "cancelled"
        except FleetError as exc:
            outcomes[rid] = type(exc).__name__
    ended = {rid: seen[rid][-1].value for rid in ids}
    tally: dict[str, int] = defaultdict(int)
    for rid in ids:
        tally[f"{'cancelled' if rid in doomed else 'left'}->{ended[rid]}"] += 1
    print(f"\ncancel ledger: {len(ids)} requests, {len(doomed)} cancelled ({sum(answers.values())} answered True); "
          f"{sum(len(s) for s in seen.values())} status reads; endings {dict(tally)}; flips {len(flips)}")
    assert not flips, flips  # one terminal state per ID, kept
    assert not [rid for rid in ids if rid not in doomed and ended[rid] == "cancelled"]
    assert {rid: outcomes[rid] for rid in ids if outcomes[rid] != ended[rid]} == {}  # result agrees with status
    assert all(answers[rid] or ended[rid] == "succeeded" for rid in doomed)  # False only where it had run
