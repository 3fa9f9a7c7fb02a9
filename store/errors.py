"""The model store's errors: branches of the fleet's one error tree (:mod:`protocol.errors`).

::

    FleetError
    ├── StoreError                  the store cannot be reached, or refused an operation (key, where)
    │   ├── ObjectExists            an exclusive write found the object already there
    │   ├── ObjectMissing           no such object in the store
    │   ├── VersionExists           publishing would overwrite a published (or claimed) version
    │   ├── VersionNotFound         no such model version is published
    │   └── CacheUnwritable         the local cache (store.cache_dir) cannot hold a fetched version
    └── ModelLoadError
        └── ChecksumMismatch        a fetched file's sha256 or size is not its manifest's

They follow :mod:`protocol.errors`' rule: ``(message, field, limit)`` positional arguments only, so
each can be rebuilt from its ``args``. ``field`` names the object key or file; ``limit`` carries what
was expected (the version, the manifest's checksum).
"""

from __future__ import annotations

from protocol.errors import FleetError, ModelLoadError

__all__ = [
    "CacheUnwritable", "ChecksumMismatch", "ObjectExists", "ObjectMissing", "StoreError", "VersionExists",
    "VersionNotFound",
]


class StoreError(FleetError):
    """The model store cannot be reached or refused an operation (names the key and the store)."""

    code = "store_error"


class ObjectExists(StoreError):
    """An exclusive write (``If-None-Match: *``) found the object already there."""

    code = "object_exists"


class ObjectMissing(StoreError):
    """The object asked for is not in the store."""

    code = "object_missing"


class VersionExists(StoreError):
    """Publishing refused: the version is already published, or another push holds its claim."""

    code = "version_exists"


class VersionNotFound(StoreError):
    """No manifest is published for this model version."""

    code = "version_not_found"

    FIX = "`fleet models list MODEL` shows the published versions; `fleet models push` publishes one"
    """The fix every refusal of an unpublished version ends with (store, CLI and worker alike)."""


class CacheUnwritable(StoreError):
    """The local cache cannot hold a fetched version (disk full, read-only, a file in the way); names the cache."""

    code = "cache_unwritable"


class ChecksumMismatch(ModelLoadError):
    """A fetched file's sha256 or size differs from its manifest's; nothing of it is used."""

    code = "checksum_mismatch"
