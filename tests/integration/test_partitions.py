"""A worker host partitioned from Redis, and a slow, lossy link, checked against the ledger.

Hosts are network namespaces (:mod:`tools.multihost`); worker host ``w1`` reaches the lab through a
:class:`~tests.integration.partition_net.TapLink`, which drops its IPv4 frames to and from Redis's host
(both ways, or only those coming back: the worker sends, nothing answers) or delays and loses them,
like ``iptables … -j DROP`` and ``tc qdisc … netem delay 200ms loss 5%`` would (this kernel has neither).
``w1`` holds what it takes in a long batch window, so a partition always catches it mid-batch.

Each test checks the ledger (:mod:`tools.ledger`: every accepted ID terminal, no stored outcome changed,
nothing left queued, unacked or held), that every result for one prompt is the same, that each request's
result was written once (the store script publishes only what it writes), and, for a partition, that
``w1`` stopped being counted (its heartbeat expired) and its held requests were served by ``w2`` after
the visibility timeout, and that once healed ``w1`` counted again and overwrote nothing.

Needs root and iproute2, as ``test_multihost.py``; ``-s`` prints each run's figures.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from protocol.messages import InferenceResult
from tests.integration.partition_fleet import (
    PROMPTS,
    PartitionFleet,
    ReadinessSamples,
    SubmitLoad,
    computed_in,
    heartbeat,
    partition_fleet,
    received_in,
)
from tests.integration.result_writes import ResultWrites
from tools.ledger import Ledger
from tools.netns import unavailable_reason
from tools.processes import WorkerProcess

WHY_NOT = unavailable_reason()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")

VISIBILITY_S = 3
HOLD_MS = 5000


def _essence(result: InferenceResult) -> dict[str, Any]:
    return result.model_dump(exclude={"timings", "request_id"})


def _held_by_w1(pf: PartitionFleet, load: SubmitLoad) -> set[str]:
    """Load requests w1 took and has not computed yet."""
    return (set(received_in(pf.w1)) - set(computed_in(pf.w1))) & set(load.ids)


def _consume(pf: PartitionFleet, w: WorkerProcess, on: bool) -> None:
    """Have ``w`` start or stop taking from the fleet's queue (Celery's ``add_consumer``/``cancel_consumer`` remote
    control), and wait for its reply: from then on it takes (or takes nothing more)."""
    control = pf.client.app.control
    command = control.add_consumer if on else control.cancel_consumer

    def send() -> Any:  # on a connection of its own: the app's pool may hold one to an earlier test's Redis
        with pf.client.app.connection_for_write() as conn:
            return command(pf.queue, destination=[w.hostname], reply=True, timeout=30, connection=conn)

    replies = pf.hf.on_client(send)
    assert replies and w.hostname in replies[0], (on, replies)


def _partitioned_mid_batch(tmp_path: Path, *, inbound: bool, outbound: bool) -> None:
    t0 = time.monotonic()
    with partition_fleet(tmp_path, visibility_s=VISIBILITY_S, hold_ms=HOLD_MS) as pf, ResultWrites(pf.hf) as writes:
        hf, on = pf.hf, pf.hf.on_client
        ledger = on(Ledger, pf.client.redis, [pf.queue])
        # w2 stops taking from the queue until w1 holds a batch: on a starved CPU, w1's frames cross the TAP link
        # through this process, and w2 could win every take (w1 then held nothing for 30 s beside stress-ng)
        _consume(pf, pf.w2, False)
        load = SubmitLoad(hf.client_host, pf.client).start()
        hf.wait(lambda: len(_held_by_w1(pf, load)) >= 3, 60, "w1 to hold requests in its batch window")
        _consume(pf, pf.w2, True)
        pf.link.partition(pf.redis_ip, inbound=inbound, outbound=outbound)
        t_cut = time.monotonic()
        held = sorted(_held_by_w1(pf, load))
        hf.wait(lambda: heartbeat(pf, pf.w1) is None, 30, "w1's heartbeat to expire (w1 no longer counted)")
        unready_s = time.monotonic() - t_cut
        held_res = on(pf.client.wait, held, 10 * VISIBILITY_S + 20)
        held_done_s = time.monotonic() - t_cut
        served_by = Counter(r.timings.worker if isinstance(r, InferenceResult) else repr(r) for r in held_res)
        for rid in held:
            on(ledger.accepted, rid)
        on(ledger.observe)  # the outcomes w2 stored: they must be the ones at the end
        w1_computed_cut_off = set(computed_in(pf.w1)) & set(held)
        pf.link.heal()
        t_heal = time.monotonic()
        hf.wait(lambda: (hb := heartbeat(pf, pf.w1)) is not None and hb["ready"], 30, "w1 counted ready again")
        ready_again_s = time.monotonic() - t_heal
        n = len(load.accepted)
        hf.wait(lambda: len(load.accepted) >= n + 40, 30, "more load after the heal")
        load.stop()
        for rid in load.ids:
            on(ledger.accepted, rid)
        results = on(pf.client.wait, load.ids, 10 * VISIBILITY_S + 30)
        hf.wait(lambda: set(held) <= set(computed_in(pf.w1)), 30, "w1 to finish the batch it held")
        report = on(ledger.check_settled, 30)
        writes.stop()
    by_prompt: dict[int, list[dict[str, Any]]] = {}
    for (_, n), res in zip(load.accepted, results, strict=True):
        if isinstance(res, InferenceResult):
            by_prompt.setdefault(n, []).append(_essence(res))
    unlike = [n for n, rs in by_prompt.items() if any(r != rs[0] for r in rs)]
    failed = {rid: repr(r) for rid, r in zip(load.ids, results, strict=True) if not isinstance(r, InferenceResult)}
    written = Counter(len(writes.writes.get(rid, [])) for rid in load.ids)
    twice = Counter(computed_in(pf.w1)) + Counter(computed_in(pf.w2))
    recomputed = sorted(rid for rid in load.ids if twice[rid] > 1)
    print(
        f"\n[partition in={inbound} out={outbound}] accepted {len(load.ids)}, refused {dict(load.refused)}, "
        f"failed {len(failed)}, ledger {report.as_dict()['violations_by_kind']} terminal {report.terminal}; "
        f"w1 held {len(held)}, served by {dict(served_by)} {held_done_s:.1f} s after the cut, computed by w1 "
        f"while cut off {len(w1_computed_cut_off)}; w1 unready {unready_s:.1f} s after the cut, ready again "
        f"{ready_again_s:.1f} s after the heal; computed twice {len(recomputed)}; result writes per ID "
        f"{dict(written)}; frames dropped {pf.link.dropped}; {time.monotonic() - t0:.1f} s in all"
    )
    report.raise_if_broken()
    assert not failed, failed
    assert held and set(served_by) == {pf.w2.hostname}, served_by
    assert not unlike, unlike
    assert set(written) == {1}, written  # each result stored once: w1, healed, overwrote none


def test_worker_partitioned_from_redis_mid_batch_then_healed(tmp_path: Path) -> None:
    """Both directions dropped (``iptables -A INPUT -s redis -j DROP`` and ``OUTPUT -d redis``)."""
    _partitioned_mid_batch(tmp_path, inbound=True, outbound=True)


def test_worker_that_sends_but_hears_nothing_from_redis(tmp_path: Path) -> None:
    """Asymmetric: w1's frames reach Redis, Redis's replies never reach w1 (only ``INPUT -s redis -j DROP``)."""
    _partitioned_mid_batch(tmp_path, inbound=True, outbound=False)


def test_slow_lossy_worker_link_keeps_serving_correctly(tmp_path: Path) -> None:
    """200 ms each way and 5 % of frames lost each way on w1's link, w1 alone serving 100 requests sent at 20/s."""
    with partition_fleet(tmp_path, visibility_s=10, hold_ms=2) as pf, ResultWrites(pf.hf) as writes:
        hf, on = pf.hf, pf.hf.on_client
        ledger = on(Ledger, pf.client.redis, [pf.queue])
        pf.w2.stop(timeout_s=15)  # a fast w2 would win every take: all the load goes over the slow link
        pf.link.set(delay_in_s=0.2, delay_out_s=0.2, loss_in=0.05, loss_out=0.05)
        t_slow = time.monotonic()
        load = SubmitLoad(hf.client_host, pf.client).start()
        seen = ReadinessSamples(pf).start()
        hf.wait(lambda: len(load.accepted) >= 100, 60, "100 requests accepted")
        load.stop()
        results = on(pf.client.wait, load.ids, 120)
        seen.stop()
        by_w1 = sum(1 for r in results if isinstance(r, InferenceResult) and r.timings.worker == pf.w1.hostname)
        for rid in load.ids:
            on(ledger.accepted, rid)
        report = on(ledger.check_settled, 60)
        slow_s = time.monotonic() - t_slow
        pf.link.heal()
        writes.stop()
    by_prompt: dict[int, list[dict[str, Any]]] = {}
    for (_, n), res in zip(load.accepted, results, strict=True):
        if isinstance(res, InferenceResult):
            by_prompt.setdefault(n, []).append(_essence(res))
    failed = {rid: repr(r) for rid, r in zip(load.ids, results, strict=True) if not isinstance(r, InferenceResult)}
    written = Counter(len(writes.writes.get(rid, [])) for rid in load.ids)
    twice = Counter(computed_in(pf.w1)) + Counter(computed_in(pf.w2))
    print(
        f"\n[slow link] accepted {len(load.ids)}, refused {dict(load.refused)}, failed {len(failed)}, served by w1 "
        f"{by_w1}, computed twice {sum(1 for rid in load.ids if twice[rid] > 1)}, result writes per ID "
        f"{dict(written)}, ledger {report.as_dict()['violations_by_kind']}; w1's heartbeat {dict(seen.counts)}; "
        f"frames passed {pf.link.passed}, "
        f"dropped {pf.link.dropped}; {slow_s:.1f} s with the slow link"
    )
    report.raise_if_broken()
    assert not failed, failed
    assert by_w1 > 0, "w1 served nothing over its slow link"
    assert all(all(r == rs[0] for r in rs) for rs in by_prompt.values())
    assert set(written) == {1}, written
    assert len(by_prompt) == len(PROMPTS)
