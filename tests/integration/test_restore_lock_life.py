"""A restore-scan lock its holder never releases stops the other workers' scans for one scan interval at most.

kombu scans for messages past their visibility timeout under a Redis lock (``SET unacked_mutex <token> NX PX
<life>``, released at the end of the scan). A worker cut off from Redis one way (it sends, hears nothing)
takes that lock and never releases it: its ``SET`` arrives, the reply does not. Measured in
``test_partitions.py``'s one-way cut with a 10 s life: MONITOR showed the cut-off worker's ``SET`` 0.05 s
after the cut, the other worker's ``SET … NX`` refused once a second for 10 s, then its scan restoring the
held requests, served 10.2 s after the cut (3.6 s after a two-way cut, where the ``SET`` never arrives).

Here a process takes the lock with the fleet's channel and dies inside it (``restore_lock_holder``): the
same lock in Redis. Worker B's scans are read from MONITOR: the ones refused (a ``SET … NX`` with no
``ZRANGE`` after it on that connection) between the dead holder's ``SET`` and B's first scan after it. B
scans once per interval (kombu's timer spaces them by at least the interval), so a lock that lives one
interval refuses at most 2 (3 when an attempt lands on the very millisecond of the expiry); the old 10 s
life refused about 10.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

from protocol.celeryconf import restore_interval_s, restore_lock_life_s
from tests.integration.fleet_fixtures import Fleet
from tests.integration.redis_monitor import Monitor
from tools.processes import poll_until

VISIBILITY_S = 3
MOST_REFUSED = 3
"""Most of B's scans a never-released lock may refuse: the scans of one interval, plus one at each end."""


def _sender(command: dict[str, Any]) -> str:
    return f"{command['client_address']}:{command['client_port']}"


def _scans_after(commands: list[dict[str, Any]], token: str) -> tuple[list[str], bool]:
    """Scan attempts (``SET unacked_mutex`` of other tokens) after the holder's ``SET``: each as ``refused`` or
    ``scanned`` (its connection sent ``ZRANGE unacked_index`` next), up to the first that scanned; and whether
    that one came."""
    start = next(i for i, c in enumerate(commands) if c["command"].startswith(f"SET unacked_mutex {token} NX"))
    outcomes: list[str] = []
    for at in range(start + 1, len(commands)):
        command = commands[at]["command"]
        if not command.startswith("SET unacked_mutex ") or " NX" not in command:
            continue
        sender = _sender(commands[at])
        following = next((c["command"] for c in commands[at + 1:] if _sender(c) == sender), None)
        if following is None:
            return outcomes, False  # its next command is not recorded yet
        if following.startswith("ZRANGE unacked_index"):
            return [*outcomes, "scanned"], True
        outcomes.append("refused")
    return outcomes, False


def test_a_restore_lock_never_released_refuses_the_other_workers_scans_for_one_interval_at_most(
    fleet: Fleet,
) -> None:
    normal = fleet.config(visibility_timeout_s=VISIBILITY_S, worker={"heartbeat_s": 0.2})
    fleet.worker(normal)  # B: ready, scanning once per interval
    monitor = Monitor(fleet.redis_url)
    try:
        holder = subprocess.run([sys.executable, "-m", "tests.integration.restore_lock_holder"],
                                env={**os.environ, "FLEET_CONFIG": str(normal)}, capture_output=True, text=True,
                                timeout=60, check=False)  # fmt: skip
        assert holder.returncode == -signal.SIGKILL and holder.stdout.startswith("holding "), holder
        token = holder.stdout.split()[1]

        def b_scanned() -> tuple[list[str], bool] | None:
            outcomes, scanned = _scans_after(monitor.up_to_now(), token)
            return (outcomes, scanned) if scanned else None

        outcomes, _ = poll_until(b_scanned, 120, "a scan of B after the dead holder's lock", poll_s=0.2)
    finally:
        monitor.close()
    refused = outcomes.count("refused")
    assert refused <= MOST_REFUSED, (
        f"B's scans were refused {refused} times by a lock its holder never released (at most {MOST_REFUSED}: "
        f"B scans every {restore_interval_s(VISIBILITY_S)} s; the lock lives {restore_lock_life_s(VISIBILITY_S)} s)"
    )
