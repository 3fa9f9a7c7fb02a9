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

Where the next pieces fit (not built yet):

* **Pins in Redis** (``fleet models pin M V``): a pin record ``{version, manifest_sha256, who, when,
  from}`` per model. :func:`resolve_model` already takes ``version=`` to override the configured
  ``store_version``, and :meth:`ModelStore.fetch` takes ``manifest_sha256=`` so a pin also fixes the
  manifest it was made against (a replaced manifest is then refused like a replaced file).
* **Hot swap**: fetching is side-effect free apart from the cache, so a worker can fetch + verify a
  new version in a background thread while the old one serves, build its engine, warm it up and
  switch between batches; a refusal (:class:`ChecksumMismatch`) leaves the old version serving.
* **Canary / rollback**: versions are immutable and listed with their ``manifest_sha256``
  (:meth:`ModelStore.versions`), so a split ``{stable: V1, canary: V2, weight}`` and a rollback
  (pin back to V1, already in every worker's cache) need nothing more from the store.
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
