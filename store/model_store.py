"""The model store's one face: :class:`ModelStore` over a backend, and :func:`open_store` from settings."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from protocol.errors import ConfigError, ModelLoadError
from protocol.settings import StoreSettings
from store.backend import Backend, ProgressBar
from store.errors import VersionNotFound
from store.fetch import fetch
from store.manifest import MANIFEST_NAME, Manifest, check_name, decode_manifest, manifest_digest, version_sort_key
from store.publish import CLAIM_NAME, publish

__all__ = ["ModelStore", "open_store"]


class ModelStore:
    """Versions of models in one bucket (or directory): publish, list, read manifests, fetch verified.

    ``cache_dir`` is where :meth:`fetch` keeps verified versions; ``reverify_cached`` re-hashes a
    cached version's files at each fetch instead of the cheap check (see :mod:`store.fetch`).
    """

    def __init__(self, backend: Backend, cache_dir: Path = Path("var/model-cache"), *, reverify_cached: bool = False):
        self.backend = backend
        self.cache_dir = Path(cache_dir)
        self.reverify_cached = reverify_cached

    @property
    def location(self) -> str:
        """Where the versions live (``s3://bucket at endpoint`` or a directory)."""
        return self.backend.location

    def models(self) -> list[str]:
        """Names of the models with at least one version folder, sorted."""
        return self.backend.children("")

    def manifest_bytes(self, model: str, version: str) -> bytes:
        """The stored bytes of the version's manifest.

        Raises:
            VersionNotFound: it is not published.
        """
        check_name(model, "model")
        check_name(version, "version")
        raw = self.backend.read(f"{model}/{version}/{MANIFEST_NAME}")
        if raw is None:
            raise VersionNotFound(f"{model} {version} is not published in {self.location}; {VersionNotFound.FIX}",
                                  "version", version)
        return raw

    def manifest(self, model: str, version: str) -> Manifest:
        """The version's manifest.

        Raises:
            VersionNotFound: it is not published. ModelLoadError: its manifest is invalid.
        """
        raw = self.manifest_bytes(model, version)
        return decode_manifest(raw, self.backend.url_of(f"{model}/{version}/{MANIFEST_NAME}"))

    def manifest_sha256(self, model: str, version: str) -> str:
        """sha256 of the version's manifest as stored (:func:`store.manifest.manifest_digest`): what a pin or
        canary records, so that workers load exactly these bytes (one read; the manifest is decoded, so an
        invalid one is refused here, not by every worker).

        Raises:
            VersionNotFound: it is not published. ModelLoadError: its manifest is invalid.
        """
        raw = self.manifest_bytes(model, version)
        decode_manifest(raw, self.backend.url_of(f"{model}/{version}/{MANIFEST_NAME}"))
        return manifest_digest(raw)

    def versions(self, model: str) -> list[dict[str, Any]]:
        """Every version folder of ``model`` in natural version order: a published one's summary
        (``state`` ``published``, ``manifest_sha256``), ``{"version", "state": "unfinished"}`` for a
        push that claimed it and has not written its manifest (running, or died), or ``{"version",
        "state": "invalid", "problem"}`` for a manifest that cannot be read or names another version
        (written by hand, or damaged): listed, so that one bad folder hides none of the others."""
        check_name(model, "model")
        out: list[dict[str, Any]] = []
        for version in sorted(self.backend.children(f"{model}/"), key=version_sort_key):
            raw = self.backend.read(f"{model}/{version}/{MANIFEST_NAME}")
            if raw is not None:
                where = self.backend.url_of(f"{model}/{version}/{MANIFEST_NAME}")
                try:
                    manifest = decode_manifest(raw, where)
                except ModelLoadError as exc:
                    out.append({"version": version, "state": "invalid", "problem": str(exc)})
                    continue
                if (manifest.model, manifest.version) != (model, version):
                    problem = f"manifest {where} describes {manifest.model} {manifest.version}"
                    out.append({"version": version, "state": "invalid", "problem": problem})
                    continue
                out.append({**manifest.summary(), "state": "published", "manifest_sha256": manifest_digest(raw)})
            elif self.backend.exists(f"{model}/{version}/{CLAIM_NAME}"):
                out.append({"version": version, "state": "unfinished"})
        return out

    def push(
        self,
        path: Path,
        model: str,
        version: str,
        *,
        takeover: bool = False,
        created_by: str | None = None,
        progress: ProgressBar | None = None,
    ) -> Manifest:
        """Publish the model at ``path`` as ``model`` ``version``; see :func:`store.publish.publish`."""
        return publish(
            self.backend, path, model, version, created_by=created_by, takeover=takeover, progress=progress
        )

    def fetch(
        self,
        model: str,
        version: str,
        cache_dir: Path | None = None,
        *,
        manifest_sha256: str | None = None,
        progress: ProgressBar | None = None,
        stop: threading.Event | None = None,
    ) -> Path:
        """The verified cached copy's ONNX file (``cache_dir`` defaults to the store's); see
        :func:`store.fetch.fetch` for what is checked and raised (and ``stop``)."""
        return fetch(
            self.backend,
            model,
            version,
            Path(cache_dir) if cache_dir is not None else self.cache_dir,
            reverify=self.reverify_cached,
            manifest_sha256=manifest_sha256,
            progress=progress,
            stop=stop,
        )


def open_store(settings: StoreSettings) -> ModelStore:
    """The store the ``store`` settings name (boto3 is imported only for an S3 store).

    Raises:
        ConfigError: ``store.backend`` is ``none``.
        StoreError: a local store's directory cannot be created.
    """
    backend: Backend
    if settings.backend == "s3":
        from store.s3 import S3Backend

        assert settings.bucket is not None  # StoreSettings requires it with backend s3
        backend = S3Backend(settings.bucket, endpoint_url=settings.endpoint_url, region=settings.region,
                            fetch_stall_timeout_s=settings.fetch_stall_timeout_s)
    elif settings.backend == "local":
        from store.local import LocalBackend

        assert settings.root is not None
        backend = LocalBackend(settings.root)
    else:
        raise ConfigError(
            "no model store is configured: set store.backend to 's3' (with store.bucket, store.endpoint_url) or "
            "'local' (with store.root); FLEET_STORE__BACKEND=s3 etc.",
            "store.backend",
            "s3|local",
        )
    return ModelStore(backend, settings.cache_dir, reverify_cached=settings.reverify_cached)
