"""Model versions in object storage: publish, list, and fetch with verified checksums.

Layout, in an S3 bucket (any S3 API: AWS, MinIO, Ceph, SeaweedFS) or a local directory::

    <bucket or root>/<model>/<version>/
        <model file>.onnx  [+ external data]  <stem>.json (card)  [tokenizer files,
        generation_config.json, tokenizer_config.json, config.json, <stem>.report.json]
        manifest.json      written last: each file's sha256 and size, kind, precision, limits, who, when
        .publishing.json   only while a push runs (or after one died): the version's claim

::

    ModelStore (model_store.py)          publish · versions · manifest · fetch      open_store(settings.store)
      ├── publish.py   graph vs card → hash → claim (exclusive put) → upload → manifest (exclusive put) → drop claim
      ├── graph_fit.py whether the ONNX file holds a model graph its card describes (pure)
      ├── fetch.py     manifest → download into .partial → verify each file → marker → rename
      ├── manifest.py  the manifest (pure, frozen, schema_version 1); names and paths checked
      ├── files.py     which files of a folder belong to a model; sha256
      └── Backend (backend.py): S3Backend (s3.py, boto3) | LocalBackend (local.py)
    resolve.py         the worker's hook: models.<m>.store_version → the verified cached file

Rules: a published version is never overwritten (conditional put ``If-None-Match: *``; see
:mod:`store.s3` for servers without it); a worker never loads a byte that was not checked against
the manifest (download, verify, then one rename into ``<cache_dir>/<model>/<version>/``); S3
credentials come from the environment / boto3's chain only.

What builds on it, elsewhere: pins, canaries and rollback are records in Redis (:mod:`protocol.model_state`,
``fleet models pin|canary|rollback``) naming versions the store publishes; :func:`resolve_model` takes
``version=`` to override the configured ``store_version`` and ``manifest_sha256=``, the digest each pin or
canary records (:meth:`ModelStore.fetch` refuses a replaced manifest like a replaced file). A worker
fetches and verifies a
new version beside the one serving and swaps between batches (:mod:`workers.version_loads`); a refusal
(:class:`ChecksumMismatch`) leaves the old version serving.
"""

from __future__ import annotations

from store.backend import Backend
from store.errors import (
    CacheUnwritable,
    ChecksumMismatch,
    ObjectExists,
    ObjectMissing,
    StoreError,
    VersionExists,
    VersionNotFound,
)
from store.fetch import fetch
from store.manifest import Manifest, ManifestFile
from store.model_store import ModelStore, open_store
from store.publish import publish
from store.resolve import resolve_model

__all__ = [
    "Backend",
    "CacheUnwritable",
    "ChecksumMismatch",
    "Manifest",
    "ManifestFile",
    "ModelStore",
    "ObjectExists",
    "ObjectMissing",
    "StoreError",
    "VersionExists",
    "VersionNotFound",
    "fetch",
    "open_store",
    "publish",
    "resolve_model",
]
