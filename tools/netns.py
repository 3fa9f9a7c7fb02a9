"""Hosts as Linux network namespaces on one machine: a private network for multi-host tests and benches.

A :class:`NetLab` is one private L2 segment: a *switch* namespace holding a Linux bridge, and one
namespace per host (:class:`NetHost`), each joined to the bridge by a veth pair (``eth0`` inside the
host, ``p-<host>`` on the switch) with an address on the lab's /24 (``10.231.0.0/24`` by default).
The root namespace has no interface on that subnet, so traffic between hosts cannot take a shortcut
through loopback or the machine's own addresses. Each lab's names carry the process id and a random
tag, so several runs (or CI jobs) on one machine never collide; :meth:`NetLab.close` removes every
namespace it made (and with them the veth pairs and the bridge).

Reaching a host from this process:

* :meth:`NetHost.popen` / :meth:`NetHost.command`: a command inside the host (``ip netns exec``);
* :meth:`NetHost.call`: run a Python callable in a thread that has joined the host's namespace
  (``setns``, per thread), so the sockets it opens are the host's; :meth:`NetHost.executor` is a
  thread pool whose every thread lives in the host.

:meth:`NetHost.link` sets the host's switch port down (a cut cable) or up again. Root and iproute2
are needed; :func:`unavailable_reason` says why a lab cannot be made here (None when it can).
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import subprocess
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any, TypeVar

__all__ = ["NetHost", "NetLab", "NetnsError", "lab_pid", "unavailable_reason"]

T = TypeVar("T")

NETNS_DIR = Path("/var/run/netns")
CLONE_NEWNET = 0x40000000
LAB_PREFIX = "fleetlab"


class NetnsError(RuntimeError):
    """An ``ip`` command or ``setns`` failed (the message has the command and its stderr)."""


def unavailable_reason() -> str | None:
    """Why a lab cannot be made on this machine (not root, no iproute2, namespaces refused); None when it can."""
    if os.geteuid() != 0:
        return "needs root to make network namespaces (ip netns)"
    if shutil.which("ip") is None:
        return "needs iproute2 (the ip command)"
    probe = f"{LAB_PREFIX}-{os.getpid()}-{secrets.token_hex(2)}-probe"
    out = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        return f"cannot make a network namespace here: {out.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


def lab_pid(netns: str) -> int | None:
    """The process id a lab's namespace name carries (``fleetlab-<pid>-<tag>-<host>``); None for other names."""
    parts = netns.split("-")
    if len(parts) < 4 or parts[0] != LAB_PREFIX or not parts[1].isdigit():
        return None
    return int(parts[1])


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {out.stderr.strip()}")


def _enter_netns(netns: str) -> None:
    """Move the calling *thread* into ``netns`` (setns is per thread; other threads stay where they are)."""
    fd = os.open(NETNS_DIR / netns, os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise NetnsError(f"setns into {netns}: {os.strerror(err)}")
    finally:
        os.close(fd)


@dataclass
class NetHost:
    """One host of a :class:`NetLab`: a network namespace with ``eth0`` at :attr:`ip` on the lab's subnet."""

    name: str
    netns: str
    ip: str
    switch_port: str
    lab: NetLab = field(repr=False)

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed so that it runs inside this host."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def popen(self, argv: Sequence[str], *, env: dict[str, str] | None = None, log: IO[bytes] | None = None,
              cwd: Path | None = None) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside this host, in its own session, output to ``log`` (or discarded); killed with us."""
        from tools.processes import die_with_parent

        return subprocess.Popen(self.command(argv), env=env, cwd=cwd, stdout=log or subprocess.DEVNULL,
                                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent)

    def enter(self) -> None:
        """Move the calling thread into this host (for a thread pool's ``initializer``)."""
        _enter_netns(self.netns)

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` on a fresh thread inside this host; returns its value or raises its error.

        Sockets ``fn`` opens belong to this host; do not keep them for use from other threads.
        """
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                self.enter()
                box["value"] = fn(*args, **kwargs)
            except BaseException as exc:  # handed to the caller below
                box["error"] = exc

        thread = threading.Thread(target=run, name=f"in-{self.name}", daemon=True)
        thread.start()
        thread.join()
        if "error" in box:
            raise box["error"]
        value: T = box["value"]
        return value

    def executor(self, max_workers: int) -> ThreadPoolExecutor:
        """A thread pool whose threads all live in this host (shut it down when done)."""
        return ThreadPoolExecutor(max_workers, thread_name_prefix=f"in-{self.name}", initializer=self.enter)

    def link(self, up: bool) -> None:
        """Set this host's switch port up or down (down = the cable is cut; its sockets stay open, silent)."""
        _ip("-n", self.lab.switch, "link", "set", self.switch_port, "up" if up else "down")


class NetLab:
    """A private /24 of hosts (network namespaces) around one bridge; a context manager that removes it all.

    Args:
        subnet: the first three octets of the lab's /24 (hosts get ``.2``, ``.3``, … in order of :meth:`add`).
    """

    def __init__(self, subnet: str = "10.231.0") -> None:
        self.subnet = subnet
        self.tag = f"{LAB_PREFIX}-{os.getpid()}-{secrets.token_hex(3)}"
        self.switch = f"{self.tag}-switch"
        self.hosts: dict[str, NetHost] = {}
        self._made: list[str] = []

    @staticmethod
    def sweep_stale() -> list[str]:
        """Delete the namespaces of labs whose process is gone (a run killed before its teardown); returns them."""
        names = sorted(p.name for p in NETNS_DIR.glob(f"{LAB_PREFIX}-*")) if NETNS_DIR.is_dir() else []
        stale = [n for n in names if (pid := lab_pid(n)) is not None and not Path(f"/proc/{pid}").exists()]
        for netns in stale:
            subprocess.run(["ip", "netns", "del", netns], capture_output=True, check=False)
        return stale

    def open(self) -> NetLab:
        """Make the switch namespace and its bridge ``br0`` (first removing what dead runs left behind).

        Raises:
            NetnsError: iproute2 refused (not root, no namespaces here).
        """
        self.sweep_stale()
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        return self

    def add(self, name: str) -> NetHost:
        """A new host ``name`` (letters/digits, <= 10 characters) on the lab's next free address.

        Raises:
            ValueError: a bad or duplicate name, or the /24 is full; NetnsError: iproute2 refused.
        """
        if not name.isalnum() or len(name) > 10:
            raise ValueError(f"host name {name!r}: letters and digits only, at most 10 characters")
        if name in self.hosts:
            raise ValueError(f"host name {name!r} is already in this lab")
        octet = len(self._made) + 1  # the switch took one slot: hosts start at .2
        if octet > 254:
            raise ValueError(f"the lab's /24 ({self.subnet}.0/24) is full: 253 hosts at most")
        netns, port = f"{self.tag}-{name}", f"p-{name}"
        _ip("netns", "add", netns)
        self._made.append(netns)
        _ip("link", "add", "eth0", "netns", netns, "type", "veth", "peer", "name", port, "netns", self.switch)
        _ip("-n", self.switch, "link", "set", port, "master", "br0")
        _ip("-n", self.switch, "link", "set", port, "up")
        ip = f"{self.subnet}.{octet}"
        _ip("-n", netns, "addr", "add", f"{ip}/24", "dev", "eth0")
        _ip("-n", netns, "link", "set", "eth0", "up")
        _ip("-n", netns, "link", "set", "lo", "up")
        host = NetHost(name=name, netns=netns, ip=ip, switch_port=port, lab=self)
        self.hosts[name] = host
        return host

    def close(self) -> None:
        """Delete every namespace of the lab (stop the processes inside first: a namespace lives while they do)."""
        for netns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", netns], capture_output=True, check=False)
        self._made.clear()
        self.hosts.clear()

    def __enter__(self) -> NetLab:
        try:
            return self.open()
        except BaseException:
            self.close()
            raise

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
