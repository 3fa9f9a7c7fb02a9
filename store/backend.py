"""What the model store needs from an object store: a handful of key operations.

Keys are ``/``-separated (``demo-lm/1.2.3/manifest.json``). Two implementations: :class:`store.s3.S3Backend`
(boto3: AWS, MinIO, Ceph, SeaweedFS) and :class:`store.local.LocalBackend` (a directory). Everything
above them (publishing, listing, verified fetching) is written once against this protocol.

Progress callbacks get the number of bytes moved since the previous call.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Protocol

from store.errors import StoreError

__all__ = ["READ_LIMIT_BYTES", "Backend", "Progress", "ProgressBar", "progress_bar", "too_large"]

Progress = Callable[[int], None]
"""Takes the number of bytes moved since the previous call."""

ProgressBar = Callable[[str, int], AbstractContextManager[Progress]]
"""``bar(description, total_bytes)`` → a context whose value is a :data:`Progress` (e.g. tqdm's update)."""


def _ignore(_n: int) -> None:
    return None


def progress_bar(bar: ProgressBar | None, description: str, total_bytes: int) -> AbstractContextManager[Progress]:
    """``bar(description, total_bytes)``, or a context that ignores progress when ``bar`` is None."""
    return bar(description, total_bytes) if bar is not None else nullcontext(_ignore)


READ_LIMIT_BYTES = 64 * 1024 * 1024
"""The largest object :meth:`Backend.read` reads whole into memory (bytes): a manifest, a claim or a card's file
(a tokenizer's JSON runs to a few MB). Before, a read had no limit: a stray multi-GB object under a manifest's
name was read into the worker's memory."""


def too_large(url: str, size: int | None, max_bytes: int) -> StoreError:
    """The error of an object past :meth:`Backend.read`'s limit (``size``: its bytes, None when not known)."""
    what = f"{size} bytes" if size is not None else f"more than {max_bytes} bytes"
    return StoreError(f"{url} is {what}; an object read whole is at most {max_bytes} bytes (a manifest, a claim or "
                      "a card's file): is it the object you meant?", "max_bytes", max_bytes)  # fmt: skip


class Backend(Protocol):
    """One bucket (or directory) of objects."""

    @property
    def location(self) -> str:
        """Where the objects live, for messages: ``s3://bucket (endpoint)`` or a directory."""
        ...

    def url_of(self, key: str) -> str:
        """``key`` as a person would find it: ``s3://bucket/key`` or a file path."""
        ...

    def read(self, key: str, *, max_bytes: int = READ_LIMIT_BYTES) -> bytes | None:
        """The object's bytes; None when there is no such object. For the small objects read whole (manifests,
        claims, cards and their files); model files are downloaded to disk.

        Raises:
            StoreError: the store cannot be reached or refused (credentials, no bucket), or the object is larger
                than ``max_bytes`` (:func:`too_large`: nothing past the limit is read).
        """
        ...

    def write(self, key: str, data: bytes, *, exclusive: bool = False) -> None:
        """Store ``data`` under ``key``. ``exclusive``: only if no object is there yet (S3's
        ``If-None-Match: *``; see :class:`store.s3.S3Backend` for servers without it).

        Raises:
            ObjectExists: ``exclusive`` and the key is taken.
            StoreError: the store cannot be reached or refused.
        """
        ...

    def upload(self, key: str, source: Path, progress: Progress | None = None, *, exclusive: bool = False) -> int:
        """Store the file ``source`` under ``key`` (multipart when large); returns the stored size in bytes.
        ``exclusive``: only if no object is there when the upload lands (as :meth:`write`; S3's
        ``If-None-Match: *`` on the PUT or on completing the multipart upload).

        Raises:
            ObjectExists: ``exclusive`` and the key was taken before this upload landed.
            StoreError: the store cannot be reached or refused.
        """
        ...

    def download(self, key: str, dest: Path, progress: Progress | None = None) -> None:
        """Write the object's bytes to ``dest`` (its folder exists; the file is created or replaced).

        Raises:
            ObjectMissing: no such object.
            StoreError: the store cannot be reached or refused.
        """
        ...

    def exists(self, key: str) -> bool:
        """True when an object is stored under ``key``."""
        ...

    def children(self, prefix: str) -> list[str]:
        """Names of the "folders" right under ``prefix`` (``""`` or ending in ``/``), sorted."""
        ...

    def keys(self, prefix: str) -> list[str]:
        """Every object key under ``prefix`` (ending in ``/``), at any depth, dot-files included, sorted.

        Raises:
            StoreError: the store cannot be reached or refused.
        """
        ...

    def delete(self, key: str) -> None:
        """Remove the object (no error when it is not there)."""
        ...
