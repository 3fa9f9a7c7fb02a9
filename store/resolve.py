"""The worker's hook into the store: which file a model is loaded from.

:func:`resolve_model` is called for every version a worker loads (:func:`workers.engines.load_version`:
the configured or pinned stable version at start, then each pinned or canary version the reconciler
switches to), before the card, the engine and the tokenizer: a store version is fetched and verified
into the local cache, and the settings the worker then uses point at the cached file.
"""

from __future__ import annotations

import logging

from protocol.settings import FleetSettings, ModelSettings
from store.model_store import open_store

__all__ = ["resolve_model"]

log = logging.getLogger("fleet.store")


def resolve_model(settings: FleetSettings, key: str, *, version: str | None = None) -> ModelSettings:
    """``models.<key>`` as the worker should load it.

    Unchanged when neither ``version`` nor ``models.<key>.store_version`` is set. Otherwise that
    version is fetched (:meth:`store.ModelStore.fetch`: downloaded, every file's sha256 and size
    checked, or taken from the cache) and the returned settings have ``path`` = its ONNX file in the
    cache and ``version`` = the store version (what every result then reports; a store version names
    exactly one set of bytes, so ``models.<key>.version`` does not override it).

    ``version`` overrides the configured ``store_version``: the seam for a version pinned in Redis.

    Raises:
        ConfigError: a version is asked for but no store is configured.
        ChecksumMismatch (a ModelLoadError): a file is not what the manifest says; nothing is loaded.
        VersionNotFound / StoreError: not published, or the store cannot be reached (and the version
            is not cached).
    """
    model = settings.models[key]
    wanted = version or model.store_version
    if wanted is None:
        return model
    store = open_store(settings.store)
    path = store.fetch(key, wanted)
    log.info("model %s version %s from the store %s: verified copy %s", key, wanted, store.location, path)
    return model.model_copy(update={"path": path, "version": wanted})
