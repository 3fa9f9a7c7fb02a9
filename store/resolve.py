"""The worker's hook into the store: which file a model is loaded from.

:func:`resolve_model` is called for every version a worker loads (:func:`workers.engines.load_version`:
the configured or pinned stable version at start, then each pinned or canary version the reconciler
switches to), before the card, the engine and the tokenizer: a store version is fetched and verified
into the local cache, and the settings the worker then uses point at the cached file. Without a store, the
one version a worker can load by name is its configured file's (:func:`configured_file_version`): a pin or
canary of that version is the configured file (``fleet models pin`` allows exactly that one).
"""

from __future__ import annotations

import logging
import threading

from protocol.errors import ModelLoadError
from protocol.modelcard import load_card
from protocol.settings import FleetSettings, ModelSettings
from store.model_store import open_store

__all__ = ["configured_file_version", "resolve_model"]

log = logging.getLogger("fleet.store")


def resolve_model(
    settings: FleetSettings, key: str, *, version: str | None = None, manifest_sha256: str | None = None,
    stop: threading.Event | None = None,
) -> ModelSettings:
    """``models.<key>`` as the worker should load it.

    Unchanged when neither ``version`` nor ``models.<key>.store_version`` is set. Otherwise that
    version is fetched (:meth:`store.ModelStore.fetch`: downloaded, every file's sha256 and size
    checked, or taken from the cache) and the returned settings have ``path`` = its ONNX file in the
    cache and ``version`` = the store version (what every result then reports; a store version names
    exactly one set of bytes, so ``models.<key>.version`` does not override it).

    ``version`` overrides the configured ``store_version``: the seam for a version pinned in Redis.
    Without a store, ``version`` equal to :func:`configured_file_version` is the configured file (unchanged).
    ``manifest_sha256``: the digest the pin or canary recorded (``ModelState.stable_manifest_sha256``): the version
    is loaded only from that manifest, in the cache or the store (None: any, as for the configured
    ``store_version``). Ignored without a store (the configured file has no manifest).
    ``stop``: the fetch ends early once it is set (:class:`store.fetch.Stopped`, raised).

    Raises:
        ConfigError: another version is asked for but no store is configured.
        ChecksumMismatch (a ModelLoadError): a file is not what the manifest says, or the manifest is not the
            pinned one (field ``manifest_sha256``); nothing is loaded.
        VersionNotFound / StoreError: not published, or the store cannot be reached (and the version
            is not cached).
    """
    model = settings.models[key]
    wanted = version or model.store_version
    if wanted is None or (settings.store.backend == "none" and wanted == configured_file_version(settings, key)):
        return model
    store = open_store(settings.store)
    path = store.fetch(key, wanted, manifest_sha256=manifest_sha256, stop=stop)
    log.info("model %s version %s from the store %s: verified copy %s", key, wanted, store.location, path)
    return model.model_copy(update={"path": path, "version": wanted})


def configured_file_version(settings: FleetSettings, key: str) -> str | None:
    """The version label of ``models.<key>``'s configured file (``models.<key>.version``, else its card's) when
    no store is configured: the only version a worker without a store can load by name. None with a store
    (versions come from it), or when the card cannot be read (the load then says why)."""
    model = settings.models[key]
    if settings.store.backend != "none" or model.store_version is not None:
        return None
    if model.version is not None:
        return model.version
    try:
        return load_card(model.path).version
    except (ModelLoadError, OSError):
        return None
