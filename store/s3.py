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

Timeouts (how long a hung store holds a thread; botocore 1.44 / s3transfer 0.19): a connection gives up
after :data:`CONNECT_TIMEOUT_S` (5 s), a socket read that receives nothing after :data:`READ_TIMEOUT_S`
(60 s, botocore's default too; a read that gets bytes restarts the clock, so a slow store is not cut
off). A request that times out is retried :data:`RETRIES` (3) times after the first attempt (botocore's
``max_attempts``, standard mode: 4 attempts in all, backoff under a second). A store that accepts
connections and never answers (stopped, as the tests do with SIGSTOP) so fails a request, a
:meth:`S3Backend.read` (a manifest) or the start of a :meth:`S3Backend.download`, after about
4 x 60 s = 4 min; a download whose body stalls once it began is asked for again by s3transfer up to
``num_download_attempts`` (5) times, each a request of 4 attempts: about 20 min at worst. Both end in a
:class:`StoreError` (``tests/integration/test_superseded_loads.py`` checks both with the read timeout
scaled down); a load stuck there meanwhile is abandoned by the reconciler, not waited for
(:mod:`workers.version_loads`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import boto3
from boto3.exceptions import RetriesExceededError, S3UploadFailedError
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, PartialCredentialsError

from store.backend import Progress
from store.errors import ObjectExists, ObjectMissing, StoreError

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
    ) -> None:
        self.bucket = bucket
        self.endpoint_url = endpoint_url
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

    @property
    def location(self) -> str:
        return f"s3://{self.bucket}" + (f" at {self.endpoint_url}" if self.endpoint_url else "")

    def url_of(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def _fail(self, exc: Exception, key: str, doing: str) -> NoReturn:
        """Raise the store error that ``exc`` (from boto3) stands for."""
        where = f"{self.url_of(key)}" + (f" at {self.endpoint_url}" if self.endpoint_url else "")
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
            raise StoreError(message, key, code) from exc
        raise StoreError(f"cannot {doing} {where}: {exc}", key, None) from exc

    def _unless_missing(self, exc: ClientError | BotoCoreError, key: str, doing: str) -> None:
        """Return when ``exc`` says there is no such object; otherwise raise the store error it stands for."""
        if isinstance(exc, ClientError) and _code(exc) in _MISSING:
            return
        self._fail(exc, key, doing)

    def read(self, key: str) -> bytes | None:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except (ClientError, BotoCoreError) as exc:
            self._unless_missing(exc, key, "read")
            return None

    def write(self, key: str, data: bytes, *, exclusive: bool = False) -> None:
        extra: dict[str, Any] = {"IfNoneMatch": "*"} if exclusive and self._conditional else {}
        if exclusive and not self._conditional and self.exists(key):
            raise ObjectExists(f"{self.url_of(key)} already exists", key, "absent")
        try:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=data, **extra)
        except ClientError as exc:
            code = _code(exc)
            if extra and code in _TAKEN:
                raise ObjectExists(f"{self.url_of(key)} already exists", key, "absent") from exc
            if extra and code in _UNSUPPORTED:
                log.warning(
                    "%s does not support conditional puts (If-None-Match: *): exclusive writes fall back to "
                    "check-then-put, which two concurrent writers can both pass",
                    self.endpoint_url or "this S3 endpoint",
                )
                self._conditional = False
                self.write(key, data, exclusive=True)
                return
            self._fail(exc, key, "write")
        except BotoCoreError as exc:
            self._fail(exc, key, "write")

    def upload(self, key: str, source: Path, progress: Progress | None = None) -> int:
        try:
            self.client.upload_file(str(source), self.bucket, key, Callback=progress, Config=_TRANSFER)
            return int(self.client.head_object(Bucket=self.bucket, Key=key)["ContentLength"])
        except S3UploadFailedError as exc:
            cause = exc.__context__
            self._fail(cause if isinstance(cause, ClientError | BotoCoreError) else exc, key, "upload")
        except (ClientError, BotoCoreError) as exc:
            self._fail(exc, key, "upload")

    def download(self, key: str, dest: Path, progress: Progress | None = None) -> None:
        try:
            self.client.download_file(self.bucket, key, str(dest), Callback=progress, Config=_TRANSFER)
        except RetriesExceededError as exc:  # s3transfer gave up on a stalled body (timeouts): the store, not the key
            cause = getattr(exc, "last_exception", None)  # the stubs do not declare it
            self._fail(cause if isinstance(cause, ClientError | BotoCoreError) else exc, key, "download")
        except (ClientError, BotoCoreError) as exc:
            self._unless_missing(exc, key, "download")
            raise ObjectMissing(f"{self.url_of(key)} does not exist", key, None) from exc

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

    def delete(self, key: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=key)
        except (ClientError, BotoCoreError) as exc:
            self._fail(exc, key, "delete")


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))
