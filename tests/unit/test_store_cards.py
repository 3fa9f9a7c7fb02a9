"""The cards a version check compares (:mod:`store.cards`), on a local-directory store with tiny models."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from protocol.errors import IncompatibleVersion
from protocol.settings import FleetSettings, load_settings
from store import ModelStore
from store.cards import check_fits, published_card, reference_card, version_check
from store.local import LocalBackend
from tests.unit.test_store_local import _write_model


def _model(folder: Path, stem: str, **card: Any) -> Path:
    """A tiny model whose card has ``card``'s fields changed."""
    path = _write_model(folder, stem)
    doc = json.loads(path.with_suffix(".json").read_text())
    path.with_suffix(".json").write_text(json.dumps({**doc, **card}))
    return path


@pytest.fixture
def store(tmp_path: Path) -> ModelStore:
    return ModelStore(LocalBackend(tmp_path / "store"), tmp_path / "cache")


def _settings(tmp_path: Path, **tiny: Any) -> FleetSettings:
    return load_settings(
        None, store={"backend": "local", "root": str(tmp_path / "store"), "cache_dir": str(tmp_path / "cache")},
        models={"tiny": tiny},
    )


def test_a_published_card_is_read_without_fetching_the_version(store: ModelStore, tmp_path: Path) -> None:
    store.push(_model(tmp_path / "enc", "enc-1.0.0", kind="encoder", vocab_size=1024), "tiny", "2.0.0")
    card = published_card(store, "tiny", "2.0.0")
    assert card is not None and (card.kind, card.vocab_size) == ("encoder", 1024)
    assert not (tmp_path / "cache").exists()  # only the card's bytes were read

    (tmp_path / "store" / "tiny" / "2.0.0" / "enc-1.0.0.json").write_text(json.dumps({"kind": "encoder"}))
    assert published_card(store, "tiny", "2.0.0") is None  # not the manifest's bytes: not trusted


def test_the_models_card_is_its_configured_versions_from_the_cache_else_the_store(
    store: ModelStore, tmp_path: Path
) -> None:
    store.push(_model(tmp_path / "lm", "tiny-1.0.0"), "tiny", "1.0.0")
    settings = _settings(tmp_path, store_version="1.0.0")
    card = reference_card(settings, "tiny")
    assert card is not None and card.kind == "causal_lm"
    store.fetch("tiny", "1.0.0")
    shutil.rmtree(tmp_path / "store")  # the store is gone: the verified cached copy answers
    card = reference_card(settings, "tiny")
    assert card is not None and card.vocab_size == 512

    settings = _settings(tmp_path, path=str(tmp_path / "lm" / "tiny-1.0.0.onnx"))
    assert reference_card(settings, "tiny") == card
    assert reference_card(_settings(tmp_path, path=str(tmp_path / "nowhere.onnx")), "tiny") is None


def test_a_version_that_does_not_fit_is_refused_and_one_that_fits_passes(store: ModelStore, tmp_path: Path) -> None:
    configured = _model(tmp_path / "lm", "tiny-1.0.0")
    store.push(_model(tmp_path / "enc", "enc-1.0.0", kind="encoder"), "tiny", "2.0.0")
    store.push(_model(tmp_path / "wide", "wide-1.0.0", vocab_size=1024), "tiny", "2.1.0")
    store.push(_model(tmp_path / "int8", "tiny-1.0.0-int8", quantization="int8-dynamic"), "tiny", "1.1.0")
    settings = _settings(tmp_path, path=str(configured))
    check = version_check(settings, store)

    with pytest.raises(IncompatibleVersion, match=r"^tiny 2\.0\.0 is an encoder model \(embeddings\); tiny is a "
                       r"causal_lm: a version must have its model's kind, vocab_size"):
        check("tiny", "2.0.0")
    with pytest.raises(IncompatibleVersion, match=r"tiny 2\.1\.0 does not fit tiny: vocab_size 1024 \(the model's"):
        check("tiny", "2.1.0")
    check("tiny", "1.1.0")

    card = published_card(store, "tiny", "2.0.0")
    assert card is not None
    with pytest.raises(IncompatibleVersion):
        check_fits(settings, "tiny", "2.0.0", card)
    # the model's card cannot be read here: left to where it can (logged), never refused blindly
    check_fits(_settings(tmp_path, path=str(tmp_path / "nowhere.onnx")), "tiny", "2.0.0", card)
