"""Network faults on one host of a :class:`~tools.netns.NetLab`, where the kernel has no ``netem`` and no ``nft``.

:class:`TapLink` replaces a lab host's veth pair by two TAP devices with the same names (``eth0`` in the
host, ``p-<host>`` on the switch's bridge) and copies Ethernet frames between them on one thread of this
process. Each frame crosses that thread, so it can be held back (a fixed one-way delay, like ``tc qdisc …
netem delay``), dropped at random (``netem loss``), or dropped when it is IPv4 between the host and a given
peer, one direction or both (what ``iptables -A INPUT/OUTPUT -s/-d <peer> -j DROP`` inside the host does).
ARP always passes, so a partition from one peer leaves the host's other links as they were, and an
asymmetric one (the host sends, nothing comes back) stays asymmetric: the peers keep resolving each other.

Why not ``tc``/``iptables``: the CI machine's kernel (a Firecracker guest) is built without ``sch_netem``
and ``act_gact``, and ships neither ``iptables`` nor ``nft``; TUN/TAP and bridges it has. The host keeps
its name, address and switch port, so :meth:`tools.netns.NetHost.link` still cuts the cable.
"""

from __future__ import annotations

import contextlib
import fcntl
import heapq
import ipaddress
import os
import random
import select
import struct
import subprocess
import threading
import time
from dataclasses import dataclass, field

from tools.netns import NetHost

__all__ = ["LinkFaults", "TapLink"]

_TUNSETIFF = 0x400454CA
_IFF_TAP = 0x0002
_IFF_NO_PI = 0x1000
_ETH_IPV4 = b"\x08\x00"
_FRAME_MAX = 65536


@dataclass
class LinkFaults:
    """What a :class:`TapLink` does to frames now. Delays are one-way, in seconds; losses are probabilities.

    ``blocked_in`` / ``blocked_out``: peer addresses whose IPv4 frames to / from the host are dropped.
    """

    delay_in_s: float = 0.0
    delay_out_s: float = 0.0
    loss_in: float = 0.0
    loss_out: float = 0.0
    blocked_in: frozenset[bytes] = field(default_factory=frozenset)
    blocked_out: frozenset[bytes] = field(default_factory=frozenset)


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")


def _open_tap(name: str) -> int:
    """A TAP device ``name`` in the calling thread's network namespace; returns its fd (the device lives while open)."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TAP | _IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


class TapLink:
    """The host's link through this process (see the module docstring); a context manager, closed by :meth:`close`.

    Make it before anything starts on the host: the veth pair it replaces goes, and with it every socket's path.
    """

    def __init__(self, host: NetHost, seed: int = 1) -> None:
        self.host = host
        self.faults = LinkFaults()
        self.dropped = {"in": 0, "out": 0}
        self.passed = {"in": 0, "out": 0}
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        switch = host.lab.switch
        _ip("-n", host.netns, "link", "del", "eth0")  # its peer on the switch goes with it
        self._host_fd: int = host.call(_open_tap, "eth0")
        # the switch namespace, reached as a host of no address: its threads' TAP devices are made there
        self._switch_fd: int = NetHost("switch", switch, "", "", host.lab).call(_open_tap, host.switch_port)
        _ip("-n", host.netns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
        _ip("-n", host.netns, "link", "set", "eth0", "up")
        _ip("-n", switch, "link", "set", host.switch_port, "master", "br0")
        _ip("-n", switch, "link", "set", host.switch_port, "up")
        self._thread = threading.Thread(target=self._run, name=f"taplink-{host.name}", daemon=True)
        self._thread.start()

    # -- faults ------------------------------------------------------------------------------------
    def set(self, **changes: object) -> None:
        """Change some of :class:`LinkFaults`' fields (``blocked_*`` as iterables of dotted addresses)."""
        with self._lock:
            values = {k: getattr(self.faults, k) for k in LinkFaults.__dataclass_fields__}
            for key, value in changes.items():
                if key not in values:
                    raise TypeError(f"LinkFaults has no field {key!r}")
                if key.startswith("blocked_"):
                    if not isinstance(value, (list, tuple, set, frozenset)):
                        raise TypeError(f"{key} takes addresses, not {value!r}")
                    value = frozenset(ipaddress.IPv4Address(str(a)).packed for a in value)
                values[key] = value
            self.faults = LinkFaults(**values)

    def partition(self, peer_ip: str, *, inbound: bool = True, outbound: bool = True) -> None:
        """Drop the host's IPv4 frames from ``peer_ip`` (``inbound``) and to it (``outbound``)."""
        self.set(blocked_in=[peer_ip] if inbound else [], blocked_out=[peer_ip] if outbound else [])

    def heal(self) -> None:
        """Pass every frame again, at once (delays and losses off too)."""
        with self._lock:
            self.faults = LinkFaults()

    # -- the copying thread ------------------------------------------------------------------------
    def _verdict(self, frame: bytes, inbound: bool, faults: LinkFaults) -> float | None:
        """When to pass ``frame`` (seconds from now), or None to drop it."""
        if frame[12:14] == _ETH_IPV4 and len(frame) >= 34:
            peer = frame[26:30] if inbound else frame[30:34]
            if peer in (faults.blocked_in if inbound else faults.blocked_out):
                return None
            loss = faults.loss_in if inbound else faults.loss_out
            if loss and self._random.random() < loss:
                return None
            return faults.delay_in_s if inbound else faults.delay_out_s
        return 0.0  # ARP and the rest pass untouched

    def _run(self) -> None:
        later: list[tuple[float, int, int, bytes]] = []  # (due, order, fd to write, frame)
        order = 0
        fds = [self._host_fd, self._switch_fd]
        while not self._stop.is_set():
            timeout = 0.2 if not later else max(0.0, min(0.2, later[0][0] - time.monotonic()))
            readable, _, _ = select.select(fds, [], [], timeout)
            now = time.monotonic()
            for fd in readable:
                with contextlib.suppress(BlockingIOError, OSError):
                    while True:
                        frame = os.read(fd, _FRAME_MAX)
                        inbound = fd == self._switch_fd
                        out_fd = self._host_fd if inbound else self._switch_fd
                        side = "in" if inbound else "out"
                        delay = self._verdict(frame, inbound, self.faults)
                        if delay is None:
                            self.dropped[side] += 1
                            continue
                        self.passed[side] += 1
                        if delay <= 0 and not later:
                            _write(out_fd, frame)
                        else:
                            order += 1
                            heapq.heappush(later, (now + delay, order, out_fd, frame))
            now = time.monotonic()
            while later and later[0][0] <= now:
                _, _, out_fd, frame = heapq.heappop(later)
                _write(out_fd, frame)

    def close(self) -> None:
        """Stop copying and close both TAP devices (the host is then off the network)."""
        self._stop.set()
        self._thread.join(5)
        for fd in (self._host_fd, self._switch_fd):
            with contextlib.suppress(OSError):
                os.close(fd)

    def __enter__(self) -> TapLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _write(fd: int, frame: bytes) -> None:
    with contextlib.suppress(OSError):  # a port set down (a cut cable) refuses the frame: it is lost
        os.write(fd, frame)
