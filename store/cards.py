"""The two cards a version check compares (:mod:`protocol.version_fit`): the model's and a version's.

* The **model's card** (:func:`reference_card`) is the card of the configured version: the file next
  to ``models.<m>.path``, or for a model served from the store the card of ``models.<m>.store_version``
  (the worker's verified cached copy when there is one, else read from the store). It is what
  producers validate and tokenize against, so every version must fit it.
* A **published version's card** (:func:`published_card`) is read from the store without fetching the
  model: only its card (or ``config.json``) file, checked against the manifest's sha256.

:func:`check_fits` is the worker's check at load (:func:`workers.engines.load_version`) and, through
:func:`version_check`, ``fleet models pin|canary|promote``'s before the state changes. Either raises
:class:`~protocol.errors.IncompatibleVersion`; a model card that cannot be read here skips the check
(logged), so a store that is down never stops a worker from loading a version it has cached.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
from collections.abc import Callable
from pathlib import Path

from protocol.errors import ConfigError, ModelLoadError
from protocol.modelcard import ModelCard, card_path_for, load_card
from protocol.settings import FleetSettings
from protocol.version_fit import incompatibility
from store.errors import StoreError
from store.fetch import cached_model_file
from store.model_store import ModelStore, open_store

__all__ = ["check_fits", "published_card", "reference_card", "version_check"]

log = logging.getLogger("fleet.store")

VersionCheck = Callable[[str, str], None]
"""``check(model, version)``: raises when ``version`` may not serve ``model``."""


def published_card(store: ModelStore, model: str, version: str) -> ModelCard | None:
    """The card of ``model`` ``version`` as published (its card file, else its ``config.json``); None
    when the version has neither, or the bytes are not the manifest's or not a usable card.

    Raises:
        VersionNotFound: the version is not published. StoreError: the store cannot be reached.
    """
    manifest = store.manifest(model, version)
    card_file = card_path_for(Path(manifest.model_file)).as_posix()
    wanted = [f for f in manifest.files if f.path in (card_file, "config.json")]
    if not wanted:
        return None
    with tempfile.TemporaryDirectory(prefix="fleet-card-") as tmp:
        for entry in wanted:
            raw = store.backend.read(f"{model}/{version}/{entry.path}")
            if raw is None or hashlib.sha256(raw).hexdigest() != entry.sha256:
                log.warning("%s %s: %s is missing or not its manifest's: its card is not checked here", model,
                            version, entry.path)
                return None
            target = Path(tmp) / entry.path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(raw)
        try:
            return load_card(Path(tmp) / manifest.model_file)
        except ModelLoadError as exc:
            log.warning("%s %s has no usable card (%s): it is not checked here", model, version, exc)
            return None


def reference_card(settings: FleetSettings, key: str, store: ModelStore | None = None) -> ModelCard | None:
    """The card of model ``key``'s configured version (see the module docstring); None when it cannot be
    read here (logged): no file at ``path``, no store configured or reachable for a ``store_version``."""
    model = settings.models[key]
    try:
        if model.store_version is None:
            return load_card(model.path) if model.path.is_file() else None
        cached = cached_model_file(settings.store.cache_dir / key / model.store_version, key, model.store_version)
        if cached is not None:
            return load_card(cached)
        return published_card(store or open_store(settings.store), key, model.store_version)
    except (ConfigError, ModelLoadError, StoreError) as exc:
        log.warning("cannot read the card of %s's configured version (%s): versions are not checked against it",
                    key, exc)
        return None


def check_fits(
    settings: FleetSettings, key: str, version: str, card: ModelCard, *, store: ModelStore | None = None
) -> None:
    """Refuse ``version`` of model ``key``, whose card is ``card``, when it does not fit the model's card.

    Raises:
        IncompatibleVersion: names the model, the version, each mismatch and the rule.
    """
    if version == settings.models[key].store_version:
        return  # the configured version is the model's card
    reference = reference_card(settings, key, store)
    if reference is None:
        return
    error = incompatibility(key, version, reference, card)
    if error is not None:
        raise error


def version_check(settings: FleetSettings, store: ModelStore) -> VersionCheck:
    """The check ``fleet models pin|canary|promote`` pass to :mod:`protocol.model_state`: the published
    card of the version, against the model's (a version without a readable card is left to the workers,
    which refuse it at load when it does not fit)."""

    def check(model: str, version: str) -> None:
        card = published_card(store, model, version)
        if card is not None:
            check_fits(settings, model, version, card, store=store)

    return check
