"""The model store on any S3 API (AWS, MinIO, Ceph, SeaweedFS) through boto3.

Credentials come only from boto3's own chain: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``
(/ ``AWS_SESSION_TOKEN``), ``AWS_PROFILE`` and ``~/.aws``, or an instance role. The fleet's settings
name the endpoint, bucket and region only, never a secret.

Exclusive writes use a conditional put (``If-None-Match: *``: AWS since 2024-08, MinIO, SeaweedFS
4.x, which answer 412 when the key exists). A server that answers 501 to the header gets a HEAD
then a plain PUT instead, with a warning: two writers racing inside that window can both succeed.
A server that silently ignores the header cannot be told apart; for the store that race means two
concurrent pushes of one version, the later manifest winning. Fetching verifies every file against
the manifest it read, so a version mixed from two pushes is refused at load, never served.

An exclusive :meth:`S3Backend.upload` goes through s3transfer like any upload (its progress, multipart
and retries), with ``If-None-Match: *`` added to the request that makes the object appear: the PutObject,
or the CompleteMultipartUpload of a multipart upload (AWS, MinIO and SeaweedFS 4.48 answer 412 to both when
the key is taken; a refused multipart upload is aborted by s3transfer). s3transfer 0.19 takes no such
argument (``ALLOWED_UPLOAD_ARGS``), so a botocore ``before-parameter-build`` hook on the client adds it to
those two calls for the keys an exclusive upload of this backend is sending. A 501 to it falls back to
check-then-upload, as for writes. A refused exclusive write or upload whose key holds the very bytes it sent
(same size, then same sha256, read back) succeeds: its first attempt landed and botocore retried it after
the response was lost (the retry's ``If-None-Match`` is refused by its own object).

Timeouts (how long a hung store holds a thread; botocore 1.44 / s3transfer 0.19): a connection gives up
after :data:`CONNECT_TIMEOUT_S` (5 s), a socket read that receives nothing after :data:`READ_TIMEOUT_S`
(60 s, botocore's default too; a read that gets bytes restarts the clock, so a slow store is not cut
off). A request that times out is retried :data:`RETRIES` (3) times after the first attempt (botocore's
``max_attempts``, standard mode: 4 attempts in all, backoff under a second). A store that accepts
connections and never answers (stopped, as the tests do with SIGSTOP) so fails a request, a
:meth:`S3Backend.read` (a manifest) or the start of a :meth:`S3Backend.download`, after about
4 x 60 s = 4 min; a download whose body stalls once it began is asked for again by s3transfer up to
``num_download_attempts`` (5) times, each a request of 4 attempts: about 20 min at worst. So a download is
watched as a whole: when no byte of the file arrived for ``fetch_stall_timeout_s`` (``store.fetch_stall_timeout_s``,
default :data:`FETCH_STALL_TIMEOUT_S` = 4 x 60 s, the longest one request may already wait; bytes arriving restart
it, so a slow but moving download of a large file is never cut off), the transfer is cancelled and
:meth:`S3Backend.download` raises a :class:`StoreError` naming the key and that deadline, whatever s3transfer's
retries would have done. The abandoned transfer's thread ends on its own when its socket read times out or the
store answers; nothing of it is installed. Both end in a :class:`StoreError`
(``tests/integration/test_superseded_loads.py`` checks both with the read timeout scaled down,
``tests/integration/test_store_stall_deadline.py`` the deadline); a load stuck there meanwhile is abandoned by
the reconciler, not waited for (:mod:`workers.version_loads`).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import boto3
from boto3.exceptions import S3UploadFailedError
from boto3.s3.transfer import TransferConfig, create_transfer_manager
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, PartialCredentialsError
from s3transfer.exceptions import RetriesExceededError as TransferRetriesExceeded
from s3transfer.subscribers import BaseSubscriber

from store.backend import READ_LIMIT_BYTES, Progress, too_large
from store.errors import ObjectExists, ObjectMissing, StoreError
from store.files import CHUNK_BYTES, hash_file

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

__all__ = ["S3Backend"]

log = logging.getLogger("fleet.store")

CONNECT_TIMEOUT_S = 5
"""Seconds to open a connection to the store (then retried, :data:`RETRIES`)."""
READ_TIMEOUT_S = 60
"""Seconds a socket read may wait for a byte (then retried, :data:`RETRIES`)."""
RETRIES = 3
"""Retries of a request after its first attempt (botocore's ``retries.max_attempts``: 4 attempts in all)."""

FETCH_STALL_TIMEOUT_S = READ_TIMEOUT_S * (RETRIES + 1)
"""Default of ``store.fetch_stall_timeout_s``: seconds a download may receive no byte before it is abandoned."""

_TRANSFER = TransferConfig(multipart_threshold=64 << 20, multipart_chunksize=64 << 20, max_concurrency=4)
_MISSING = {"404", "NoSuchKey", "NotFound"}
_TAKEN = {"PreconditionFailed", "ConditionalRequestConflict", "412", "409"}
_UNSUPPORTED = {"NotImplemented", "501"}


class S3Backend:
    """One bucket, reached at ``endpoint_url`` (None = AWS, or ``AWS_ENDPOINT_URL_S3``)."""

    def __init__(
        self,
        bucket: str,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        client: S3Client | None = None,
        fetch_stall_timeout_s: float = FETCH_STALL_TIMEOUT_S,
    ) -> None:
        self.bucket = bucket
        self.endpoint_url = endpoint_url
        self.fetch_stall_timeout_s = fetch_stall_timeout_s
        """Seconds a download may receive no byte before it ends in a StoreError (module docstring)."""
        self.client: S3Client = client or boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint_url,
            region_name=region,
            config=Config(
                # path style: S3-compatible servers on a host:port have no per-bucket DNS names
                s3={"addressing_style": "path" if endpoint_url else "auto"},
                retries={"max_attempts": RETRIES, "mode": "standard"},
                connect_timeout=CONNECT_TIMEOUT_S,
                read_timeout=READ_TIMEOUT_S,
            ),
        )
        self._conditional = True
        self._exclusive_keys: Counter[str] = Counter()  # keys an exclusive upload is sending: If-None-Match
        self._exclusive_lock = threading.Lock()
        for operation in ("PutObject", "CompleteMultipartUpload"):  # the two calls that make an upload land
            self.client.meta.events.register(f"before-parameter-build.s3.{operation}", self._if_none_match)

    @property
    def location(self) -> str:
        return f"s3://{self.bucket}" + (f" at {self.endpoint_url}" if self.endpoint_url else "")

    def url_of(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def _fail(self, exc: Exception, key: str, doing: str) -> NoReturn:
        """Raise the store error that ``exc`` (from boto3) stands for, naming ``key`` (the store itself, ``store``,
        for an operation on its root: a listing of every model named an empty field)."""
        where = f"{self.url_of(key)}" + (f" at {self.endpoint_url}" if self.endpoint_url else "")
        field = key or "store"
        if isinstance(exc, NoCredentialsError | PartialCredentialsError):
            raise StoreError(
                f"no S3 credentials to {doing} {where}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or "
                "AWS_PROFILE) in the environment; the fleet never reads them from its config file",
                "credentials",
                "environment",
            ) from exc
        if isinstance(exc, ClientError):
            error = exc.response.get("Error", {})
            code = str(error.get("Code", "?"))
            if code == "NoSuchBucket":
                at = self.endpoint_url or "AWS"
                raise StoreError(f"bucket {self.bucket!r} does not exist at {at}", "store.bucket", self.bucket) from exc
            message = f"S3 refused to {doing} {where}: {code} {error.get('Message', '')}".rstrip()
            raise StoreError(message, field, code) from exc
        raise StoreError(f"cannot {doing} {where}: {exc}", field, None) from exc

    def _unless_missing(self, exc: ClientError | BotoCoreError, key: str, doing: str) -> None:
        """Return when ``exc`` says there is no such object; otherwise raise the store error it stands for."""
        if isinstance(exc, ClientError) and _code(exc) in _MISSING:
            return
        self._fail(exc, key, doing)

    def read(self, key: str, *, max_bytes: int = READ_LIMIT_BYTES) -> bytes | None:
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=key)
            body = response["Body"]
            try:
                size = response.get("ContentLength")
                if size is not None and int(size) > max_bytes:  # refused before a byte of it is read
                    raise too_large(self.url_of(key), int(size), max_bytes)
                data: bytes = body.read(max_bytes + 1)  # a server that misstates the length is cut at the limit
            finally:
                body.close()
        except (ClientError, BotoCoreError) as exc:
            self._unless_missing(exc, key, "read")
            return None
        if len(data) > max_bytes:
            raise too_large(self.url_of(key), None, max_bytes)
        return data

    def write(self, key: str, data: bytes, *, exclusive: bool = False) -> None:
        extra: dict[str, Any] = {"IfNoneMatch": "*"} if exclusive and self._conditional else {}
        if exclusive and not self._conditional and self.exists(key):
            raise ObjectExists(f"{self.url_of(key)} already exists", key, "absent")
        try:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=data, **extra)
        except ClientError as exc:
            code = _code(exc)
            if extra and code in _TAKEN:
                if self._holds(key, len(data), lambda: hashlib.sha256(data).hexdigest()):
                    return  # our own PUT landed and its response was lost: botocore's retry found it
                raise ObjectExists(f"{self.url_of(key)} already exists", key, "absent") from exc
            if extra and code in _UNSUPPORTED:
                self._no_conditional_puts()
                self.write(key, data, exclusive=True)
                return
            self._fail(exc, key, "write")
        except BotoCoreError as exc:
            self._fail(exc, key, "write")

    def _no_conditional_puts(self) -> None:
        """The server answered 501 to ``If-None-Match: *``: from now on exclusive means check-then-put."""
        log.warning(
            "%s does not support conditional puts (If-None-Match: *): exclusive writes and uploads fall back to "
            "check-then-put, which two concurrent writers can both pass",
            self.endpoint_url or "this S3 endpoint",
        )
        self._conditional = False

    def upload(self, key: str, source: Path, progress: Progress | None = None, *, exclusive: bool = False) -> int:
        conditional = exclusive and self._conditional
        if exclusive and not conditional and self.exists(key):
            raise ObjectExists(f"{self.url_of(key)} already exists", key, "absent")
        try:
            with self._sending_exclusively(key) if conditional else nullcontext():
                self.client.upload_file(str(source), self.bucket, key, Callback=progress, Config=_TRANSFER)
            return int(self.client.head_object(Bucket=self.bucket, Key=key)["ContentLength"])
        except S3UploadFailedError as exc:
            cause = exc.__context__
            if conditional and isinstance(cause, ClientError) and _code(cause) in _TAKEN:
                size = source.stat().st_size
                if self._holds(key, size, lambda: hash_file(source)[0]):
                    return size  # our own upload landed and its response was lost: botocore's retry found it
                raise ObjectExists(f"{self.url_of(key)} already exists", key, "absent") from cause
            if conditional and isinstance(cause, ClientError) and _code(cause) in _UNSUPPORTED:
                self._no_conditional_puts()
                return self.upload(key, source, progress, exclusive=True)
            self._fail(cause if isinstance(cause, ClientError | BotoCoreError) else exc, key, "upload")
        except (ClientError, BotoCoreError) as exc:
            self._fail(exc, key, "upload")

    def _holds(self, key: str, size: int, sha256: Callable[[], str]) -> bool:
        """True when ``key`` holds ``size`` bytes whose sha256 is ``sha256()`` (our bytes: computed, and the object
        read back, only when the sizes match). Why: an exclusive PUT (or multipart completion) that landed but
        whose response was lost is retried by botocore, and the retry's ``If-None-Match: *`` is refused (412) by
        the object it wrote itself; the same bytes there are that upload's, or another push's identical ones
        (harmless either way)."""
        try:
            if int(self.client.head_object(Bucket=self.bucket, Key=key)["ContentLength"]) != size:
                return False
            digest = hashlib.sha256()
            for chunk in self.client.get_object(Bucket=self.bucket, Key=key)["Body"].iter_chunks(CHUNK_BYTES):
                digest.update(chunk)
        except (ClientError, BotoCoreError) as exc:
            self._unless_missing(exc, key, "read back")
            return False
        return digest.hexdigest() == sha256()

    @contextmanager
    def _sending_exclusively(self, key: str) -> Iterator[None]:
        """While inside, the PutObject / CompleteMultipartUpload of ``key`` carry ``If-None-Match: *``."""
        with self._exclusive_lock:
            self._exclusive_keys[key] += 1
        try:
            yield
        finally:
            with self._exclusive_lock:
                self._exclusive_keys[key] -= 1
                if not self._exclusive_keys[key]:
                    del self._exclusive_keys[key]

    def _if_none_match(self, params: dict[str, Any], **_kwargs: Any) -> None:
        """botocore hook (before-parameter-build): make an exclusive upload's landing request conditional."""
        if params.get("Bucket") == self.bucket and params.get("Key") in self._exclusive_keys:
            params.setdefault("IfNoneMatch", "*")

    def download(self, key: str, dest: Path, progress: Progress | None = None) -> None:
        """boto3's ``download_file``, watched: no byte for :attr:`fetch_stall_timeout_s` ends it (StoreError)."""
        watch = _Watch(progress)
        manager = create_transfer_manager(self.client, _TRANSFER)
        finished = False
        try:
            future = manager.download(self.bucket, key, str(dest), subscribers=[watch])
            while not watch.done.wait(max(0.0, watch.last_byte_s + self.fetch_stall_timeout_s - time.monotonic())):
                if time.monotonic() - watch.last_byte_s >= self.fetch_stall_timeout_s:
                    future.cancel()  # no more bytes written, nothing renamed into place
                    raise StoreError(
                        f"download of {self.url_of(key)}" + (f" at {self.endpoint_url}" if self.endpoint_url else "")
                        + f" received no byte for {self.fetch_stall_timeout_s:g} s (store.fetch_stall_timeout_s): "
                        "the store stalled; the download was abandoned",
                        key,
                        self.fetch_stall_timeout_s,
                    )
            future.result()
            finished = True
        except TransferRetriesExceeded as exc:  # s3transfer gave up on a stalled body: the store, not the key
            cause = exc.last_exception
            self._fail(cause if isinstance(cause, ClientError | BotoCoreError) else exc, key, "download")
        except (ClientError, BotoCoreError) as exc:
            self._unless_missing(exc, key, "download")
            raise ObjectMissing(f"{self.url_of(key)} does not exist", key, None) from exc
        finally:
            if finished:
                manager.shutdown()
            else:  # its threads may still wait on a stalled socket: let them end there, not here
                threading.Thread(target=manager.shutdown, kwargs={"cancel": True}, name="s3-abandoned",
                                 daemon=True).start()  # fmt: skip

    def exists(self, key: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=key)
            return True
        except (ClientError, BotoCoreError) as exc:
            self._unless_missing(exc, key, "look up")
            return False

    def children(self, prefix: str) -> list[str]:
        names: list[str] = []
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=prefix, Delimiter="/"
            )
            for page in pages:
                for common in page.get("CommonPrefixes", []):
                    name = common.get("Prefix", "")[len(prefix):].rstrip("/")
                    if name and not name.startswith("."):
                        names.append(name)
        except (ClientError, BotoCoreError) as exc:
            self._fail(exc, prefix, "list")
        return sorted(names)

    def keys(self, prefix: str) -> list[str]:
        names: list[str] = []
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
                names += [obj["Key"] for obj in page.get("Contents", []) if "Key" in obj]
        except (ClientError, BotoCoreError) as exc:
            self._fail(exc, prefix, "list")
        return sorted(names)

    def delete(self, key: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=key)
        except (ClientError, BotoCoreError) as exc:
            self._fail(exc, key, "delete")


class _Watch(BaseSubscriber):
    """s3transfer subscriber of one download: when a byte last arrived (monotonic s), and when it ended."""

    def __init__(self, progress: Progress | None) -> None:
        self.progress = progress
        self.last_byte_s = time.monotonic()
        self.done = threading.Event()

    def on_progress(self, future: Any, bytes_transferred: int, **kwargs: Any) -> None:
        if bytes_transferred > 0:  # a retry reports the lost bytes as negative progress: not a byte received
            self.last_byte_s = time.monotonic()
        if self.progress is not None:
            self.progress(bytes_transferred)

    def on_done(self, future: Any, **kwargs: Any) -> None:
        self.done.set()


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))
