"""One loaded model version: its settings, card, engine, generation loop and tokenizer.

:func:`load_version` is the whole path from a version name to an engine ready to take a batch: fetch
and verify through the store (:func:`store.resolve.resolve_model`), read the card and check that it
fits the model's (:func:`store.cards.check_fits`: a pinned or canary version of another kind or
vocabulary would answer the model's requests wrong-shaped, or fail them), open the ORT session, warm
it up at the extreme shapes. The worker runtime loads its stable version with it at
start, and the reconciler (:mod:`workers.reconcile`) loads pinned and canary versions with it while
the old engine keeps serving; nothing here touches the scheduler.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from protocol.generation_config import load_generation_defaults
from protocol.modelcard import ModelCard, load_card
from protocol.settings import FleetSettings, ModelSettings
from protocol.tokenization import Tokenizer, load_tokenizer
from store.cards import check_fits
from store.fetch import stop_if
from store.manifest import MANIFEST_NAME, manifest_digest
from store.resolve import resolve_model
from workers.engine import Engine
from workers.generation.decoder import Decoder
from workers.generation.inplace_check import InPlaceMismatch, open_decoder
from workers.generation.loop import GenerationLoop

__all__ = ["LoadedModel", "load_version"]

log = logging.getLogger("fleet.worker")


@dataclass(frozen=True)
class LoadedModel:
    """A model version loaded, verified and warmed up in this process."""

    version: str
    manifest_sha256: str | None
    """The manifest digest the load was held to (the pin's or canary's); None when none was asked for."""
    loaded_manifest_sha256: str | None
    """The digest of the manifest actually loaded (a store version's, from its verified cache folder); None for a
    model file outside the store. Recorded as served, so a worker that falls back to it loads these bytes."""
    model: ModelSettings
    """``models.<m>`` with ``path`` = the file actually loaded (the verified cache copy for a store version)."""
    card: ModelCard
    engine: Engine
    generation: GenerationLoop | None
    tokenizer: Tokenizer | None
    eos_token_ids: frozenset[int]
    load_ms: float
    """Fetch + verify + session creation + warm-up (ms)."""
    warmup_ms: float


def load_version(
    settings: FleetSettings, key: str, version: str | None = None, *, manifest_sha256: str | None = None,
    stop: threading.Event | None = None,
) -> LoadedModel:
    """Load model ``key`` at ``version`` (None: the configured ``store_version`` or ``path``).

    ``manifest_sha256``: the digest the pin or canary recorded for ``version`` (None: no check); a version
    whose manifest has another one is refused (ChecksumMismatch, "changed since it was pinned").

    ``stop`` (the reconciler's mark of a superseded load) is checked between the steps: first, after each file
    fetched (:func:`store.fetch.fetch`), after the fetch, after the session is open and after the warm-up;
    once it is set the load ends with :class:`store.fetch.Stopped` and what it built is dropped (a fetch's
    partial folder removed, the session released with the engine). A step already running is not
    interrupted.

    Raises:
        ChecksumMismatch / VersionNotFound / StoreError: the version cannot be fetched as published.
        IncompatibleVersion: ``version``'s card does not fit the model's (kind, vocab_size, …); the
            reconciler records it as a refusal like any load failure.
        ModelLoadError / ProviderUnavailable / FileNotFoundError: it cannot be opened as configured.
        Stopped: ``stop`` was set; nothing was loaded.
        Exception: ORT's own errors while creating the session or warming it up.
    """
    started = time.monotonic()
    stop_if(stop, "nothing (it had not begun)")
    model = resolve_model(settings, key, version=version, manifest_sha256=manifest_sha256, stop=stop)
    stop_if(stop, "the fetch")
    card = load_card(model.path)
    if version is not None:
        check_fits(settings, key, version, card)
    engine = Engine(model.path, card, model.engine, model.batching, model.limits)
    engine, decoder = _decoder(engine, model)
    stop_if(stop, "the session")
    warmup_ms = engine.warm_up() if model.engine.warmup else 0.0
    generation = GenerationLoop(decoder, model.batching) if decoder is not None else None
    if generation is not None and model.engine.warmup:
        warmup_ms += generation.warm_up()
    stop_if(stop, "the warm-up")
    return LoadedModel(
        version=model.version or card.version,
        manifest_sha256=manifest_sha256,
        loaded_manifest_sha256=_manifest_beside(model.path),
        model=model,
        card=card,
        engine=engine,
        generation=generation,
        tokenizer=_worker_tokenizer(card, model.path),
        eos_token_ids=frozenset(load_generation_defaults(model.path, card).eos_token_ids),
        load_ms=(time.monotonic() - started) * 1000,
        warmup_ms=warmup_ms,
    )


def _manifest_beside(model_path: str | Path) -> str | None:
    """The digest of the store manifest in the model file's folder (a verified cache copy); None where the file
    has none beside it (a model file outside the store)."""
    try:
        return manifest_digest((Path(model_path).parent / MANIFEST_NAME).read_bytes())
    except OSError:
        return None


def _decoder(engine: Engine, model: ModelSettings) -> tuple[Engine, Decoder | None]:
    """The generation decoder of a causal LM with a KV cache (None for other models), and the engine it runs on.

    An engine that serves the in-place graph (``engine.kv_cache``, :mod:`workers.inplace_graph`) gets an
    :class:`~workers.generation.inplace_decoder.InPlaceDecoder` once the probe agrees with the original
    graph (:func:`~workers.generation.inplace_check.open_decoder`); when it does not, ``auto`` reopens
    the model with its Concat cache (logged) and ``in_place`` refuses it.

    Raises:
        InPlaceMismatch: ``kv_cache: in_place`` and the probe disagrees.
    """
    if engine.card.kind != "causal_lm" or not engine.has_kv_cache:
        return engine, None
    try:
        decoder = open_decoder(engine)
    except InPlaceMismatch as exc:
        if model.engine.kv_cache == "in_place":
            raise
        log.warning("model %s %s keeps the Concat KV cache: %s", engine.card.name, engine.card.version, exc)
        settings = model.engine.model_copy(update={"kv_cache": "concat"})
        engine = Engine(model.path, engine.card, settings, model.batching, model.limits)
        return engine, Decoder(engine)
    if engine.kv.in_place:
        log.info("model %s %s: KV cache in place (GroupQueryAttention slots of %s in %s memory; probe relative "
                 "error %.1e; decode steps as CUDA graphs: %s)", engine.card.name, engine.card.version,
                 np.dtype(engine.kv_dtype).name, "device" if getattr(decoder, "slots_on_device", False) else "host",
                 getattr(decoder, "probe_error", 0.0),
                 "yes" if decoder.replays_graphs else "no")  # fmt: skip
    return engine, decoder


def served_source(model: ModelSettings, card: ModelCard) -> str | bytes:
    """The graph a worker opens for ``model`` (path or serialized): the LM-head and in-place rewrites as
    configured, and the Concat form when the in-place probe disagrees (:func:`_decoder`). Opens the model
    once to decide, without warm-up or placement profiling: the bench's limit and the tests serve the
    same graph as the workers."""
    settings = model.engine.model_copy(update={"warmup": False, "report_placement": False})
    engine = Engine(model.path, card, settings, model.batching, model.limits)
    engine, _ = _decoder(engine, model.model_copy(update={"engine": settings}))
    return engine.kv.source


def _worker_tokenizer(card: ModelCard, model_path: Path) -> Tokenizer | None:
    """The model's tokenizer for generated text and stop strings; None when it has none."""
    try:
        return load_tokenizer(card, model_path.parent)
    except Exception as exc:  # no tokenizer: generations return ids only
        log.warning("model %s has no usable tokenizer (%s): generations return token ids without text", card.name, exc)
        return None
