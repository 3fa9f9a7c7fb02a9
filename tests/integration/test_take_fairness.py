"""An idle worker waits on the queue its model's requests arrive on, so a light load reaches every worker.

The atomic take (``broker/atomic_take.py``) blocks on one list at a time. It used to stay on the list its last
take came from, and before any take on the first list of kombu's order: a worker with a queue of its own
(prefix-aware routing, on for generative models) waited there and saw the shared queue only between its
20 ms waits, by which time the worker blocked on the shared queue had taken each request. Two idle workers
and 40 requests one at a time: 40 to one worker, 0 to the other, every run.
"""

from __future__ import annotations

from collections import Counter

from tests.integration.fleet_fixtures import Fleet
from tests.integration.redis_monitor import Monitor
from tools.processes import poll_until


def test_every_idle_worker_waits_on_the_shared_queue_after_another_took_the_request(fleet: Fleet) -> None:
    cfg = fleet.config()
    queue = fleet.settings(cfg).queue_for("demo-lm")
    workers = [fleet.worker(cfg, "demo-lm", hostname=f"w{i}-fair@test") for i in (1, 2)]
    client = fleet.client(cfg)
    monitor = Monitor(fleet.redis_url)
    first = client.result(client.submit("demo-lm", text="the first request", top_k=1), wait=True, timeout_s=30)
    assert first is not None and first.timings.worker in {w.hostname for w in workers}
    after = len(monitor.up_to_now())

    def waiting_on_shared_queue() -> set[str]:
        """The connections that sent a blocking wait on the shared queue since the first result."""
        return {f"{c['client_address']}:{c['client_port']}" for c in monitor.commands[after:]
                if c["command"].startswith(f"BLMOVE {queue} {queue} ")}  # fmt: skip

    # each worker's wait on the shared queue, the one that did not take the request's included (deadline: a
    # failure bound; each worker waits 20 ms per turn)
    waiters = poll_until(lambda: len(waiting_on_shared_queue()) >= 2 and waiting_on_shared_queue(), 30,
                         "both workers' blocking waits on the shared queue")  # fmt: skip
    assert len(waiters) == 2, waiters

    served: Counter[str] = Counter()
    for i in range(40):
        result = client.result(client.submit("demo-lm", text=f"request {i}", top_k=1), wait=True, timeout_s=30)
        assert result is not None
        served[result.timings.worker or "?"] += 1
    # which idle worker takes a request is a race between the two (each is woken; the first to run the take
    # script takes it): a figure, not asserted
    print(f"\nidle workers: the shared queue waited on by {len(waiters)} connections; 40 requests one at a time "
          f"served per worker {dict(served)}")
