"""A TCP proxy in front of a real redis-server that cuts the link at a chosen command, deterministically.

Clients connect to :attr:`CutProxy.url`; each connection is relayed both ways to the server. The proxy
reads the clients' RESP commands (arrays of bulk strings, what redis-py and kombu send) and counts
those that match (:meth:`CutProxy.arm`: a command name and, optionally, its first argument, such as
``EVALSHA <sha>`` of one script). At the Nth match it cuts:

* ``"drop"``: that command is never forwarded, so Redis never runs it (the cut falls *before* it);
* ``"lose_reply"``: the command is forwarded and Redis's reply awaited, then dropped (Redis ran it,
  the client never hears so: the cut falls *inside* the client's step).

Either way every relayed connection is then closed and the proxy is *down*: it accepts new connections
and closes them at once (Redis unreachable: a client's own retries fail fast), until :meth:`restore`.
No timing is involved: the cut is tied to the command, not to a clock.
"""

from __future__ import annotations

import contextlib
import hashlib
import selectors
import socket
import threading
from typing import Literal

from producer.idempotent_queue import CLAIM_AND_QUEUE_LUA

__all__ = ["CLAIM_AND_QUEUE_SHA", "CutProxy", "parse_command"]

CLAIM_AND_QUEUE_SHA = hashlib.sha1(CLAIM_AND_QUEUE_LUA.encode()).hexdigest()
"""The ``EVALSHA`` argument of the producers' claim-and-queue script: the step that queues a request."""

Mode = Literal["drop", "lose_reply"]


def parse_command(buf: bytes | bytearray) -> tuple[list[bytes], int] | None:
    """The first complete RESP command in ``buf`` (its arguments, the bytes it takes), or None when incomplete.

    Raises:
        ValueError: ``buf`` does not start with a RESP array (inline commands are not parsed).
    """
    if not buf:
        return None
    if buf[:1] != b"*":
        raise ValueError(f"not a RESP array: {bytes(buf[:20])!r}")
    end = buf.find(b"\r\n")
    if end < 0:
        return None
    count, pos, args = int(buf[1:end]), end + 2, []
    for _ in range(count):
        end = buf.find(b"\r\n", pos)
        if end < 0:
            return None
        size = int(buf[pos + 1 : end])
        start = end + 2
        if len(buf) < start + size + 2:
            return None
        args.append(bytes(buf[start : start + size]))
        pos = start + size + 2
    return args, pos


class _Link:
    """One client connection and its connection to the server."""

    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.client, self.server = client, server
        self.pending = bytearray()  # client bytes not yet parsed into a whole command
        self.awaiting_reply = False  # "lose_reply": the armed command was forwarded; its reply is dropped


class CutProxy:
    """The proxy (see the module docstring); one thread relays every connection."""

    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._links: list[_Link] = []
        self._armed: tuple[bytes, bytes | None, int, Mode] | None = None
        self._seen = 0
        self._down = False
        self._stopping = False
        self.cut = threading.Event()
        """Set when the armed command was met and the link cut."""
        self.cut_command: list[bytes] = []
        """The command the cut fell at."""
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._run, name="cut-proxy", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def arm(self, command: str, *, nth: int, mode: Mode, first_arg: str | None = None) -> None:
        """Cut at the ``nth`` command named ``command`` (and, when given, whose first argument is ``first_arg``)
        counted from now."""
        with self._lock:
            self._armed = (command.upper().encode(), first_arg.encode() if first_arg else None, nth, mode)
            self._seen = 0
            self.cut.clear()

    def restore(self) -> None:
        """Up again: new connections are relayed (the cut is disarmed)."""
        with self._lock:
            self._down = False
            self._armed = None

    def close(self) -> None:
        self._stopping = True
        self._wake_w.send(b"x")
        self._thread.join(10)
        for link in list(self._links):
            self._drop(link)
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()

    # -- the relay thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            for key, _ in self._selector.select(timeout=None):
                sock = key.fileobj
                if sock is self._wake_r:
                    continue
                if sock is self._listener:
                    self._accept()
                elif isinstance(key.data, tuple):
                    link, from_client = key.data
                    if link in self._links:
                        self._relay(link, from_client)

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        client.setblocking(True)
        if self._down:
            client.close()  # Redis unreachable: the client's retries fail at once
            return
        server = socket.create_connection(self.upstream)
        link = _Link(client, server)
        self._links.append(link)
        self._selector.register(client, selectors.EVENT_READ, (link, True))
        self._selector.register(server, selectors.EVENT_READ, (link, False))

    def _relay(self, link: _Link, from_client: bool) -> None:
        src = link.client if from_client else link.server
        try:
            data = src.recv(65536)
        except OSError:
            data = b""
        if not data:
            self._drop(link)
            return
        if not from_client:
            if link.awaiting_reply:  # Redis answered the armed command: it ran; the client never hears it
                self._go_down()
                return
            link.client.sendall(data)
            return
        link.pending += data
        while True:
            parsed = parse_command(link.pending)
            if parsed is None:
                return
            args, used = parsed
            raw = bytes(link.pending[:used])
            del link.pending[:used]
            if self._is_cut_at(args):
                self.cut_command = args
                if self._armed is not None and self._armed[3] == "lose_reply":
                    link.server.sendall(raw)
                    link.awaiting_reply = True
                    return
                self._go_down()
                return
            link.server.sendall(raw)

    def _is_cut_at(self, args: list[bytes]) -> bool:
        with self._lock:
            if self._armed is None or not args:
                return False
            name, first, nth, _ = self._armed
            if args[0].upper() != name or (first is not None and (len(args) < 2 or args[1] != first)):
                return False
            self._seen += 1
            return self._seen == nth

    def _go_down(self) -> None:
        """Close every relayed connection; refuse new ones until :meth:`restore`."""
        with self._lock:
            self._down = True
            self._armed = None
        self.cut.set()  # before the close the client hears of
        for link in list(self._links):
            self._drop(link)

    def _drop(self, link: _Link) -> None:
        if link not in self._links:
            return
        self._links.remove(link)
        for sock in (link.client, link.server):
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(sock)
            sock.close()

