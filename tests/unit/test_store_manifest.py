"""The store's pure parts: names, precision, the manifest's rules, its codec; the ``store`` settings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from protocol.errors import ConfigError, InvalidRequest, ModelLoadError
from protocol.modelcard import ModelCard
from protocol.settings import FleetSettings, StoreSettings, load_settings
from store.manifest import (
    Manifest,
    ManifestFile,
    check_name,
    decode_manifest,
    encode_manifest,
    manifest_digest,
    precision_for,
    version_sort_key,
)

SHA_A = "a" * 64
SHA_B = "b" * 64


def _card(**changes: Any) -> ModelCard:
    base: dict[str, Any] = {"name": "m", "version": "1.0.0", "kind": "causal_lm", "vocab_size": 512,
                            "max_positions": 256, "num_layers": 2, "num_heads": 4, "head_dim": 16, "hidden_size": 64}
    return ModelCard(**{**base, **changes})


def _files() -> list[ManifestFile]:
    return [
        ManifestFile(path="m.onnx", role="model", sha256=SHA_A, size_bytes=100),
        ManifestFile(path="m.json", role="card", sha256=SHA_B, size_bytes=20),
    ]


def _manifest(**changes: Any) -> Manifest:
    good = Manifest.build(model="demo-lm", version="1.2.3", card=_card(), files=_files(), created_by="a@h",
                          now_unix_s=1_800_000_000.0)
    return Manifest.model_validate({**good.model_dump(), **changes})


@pytest.mark.parametrize("name", ["demo-lm", "1.2.3", "1.2.3-int8", "v2+build.7", "A_b"])
def test_good_names(name: str) -> None:
    assert check_name(name, "version") == name


@pytest.mark.parametrize("name", ["", "..", "a/b", ".hidden", "-x", "a..b", "a b", "x" * 129, "a\\b"])
def test_bad_names_are_refused_naming_the_field(name: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        check_name(name, "version")
    assert err.value.field == "version"


@pytest.mark.parametrize(
    ("quantization", "precision"),
    [(None, "fp32"), ("", "fp32"), ("fp32", "fp32"), ("fp16", "fp16"), ("float16", "fp16"),
     ("int8-dynamic", "int8"), ("int8-static-qdq-symmetric", "int8")],
)
def test_precision_from_the_cards_quantization(quantization: str | None, precision: str) -> None:
    assert precision_for(_card(quantization=quantization)) == precision


def test_an_unknown_quantization_is_refused() -> None:
    with pytest.raises(InvalidRequest) as err:
        precision_for(_card(quantization="int4-awq"))
    assert err.value.field == "quantization"


def test_build_fills_kind_limits_totals_and_time() -> None:
    m = _manifest()
    assert (m.model_file, m.kind, m.precision, m.card_version) == ("m.onnx", "causal_lm", "fp32", "1.0.0")
    assert m.limits.max_positions == 256 and m.limits.vocab_size == 512
    assert m.total_bytes == 120 and [f.path for f in m.files] == ["m.json", "m.onnx"]  # sorted
    assert m.created_at == "2027-01-15T08:00:00Z" and m.created_by == "a@h"


def test_encode_decode_round_trip_and_digest() -> None:
    m = _manifest()
    raw = encode_manifest(m)
    assert decode_manifest(raw, "here") == m
    assert manifest_digest(raw) == manifest_digest(encode_manifest(decode_manifest(raw, "here")))


@pytest.mark.parametrize(
    ("path", "rule"),
    [("../etc/passwd", "plain relative"), ("/abs.onnx", "plain relative"), ("a//b", "plain relative"),
     ("a\\b", "plain relative"), ("manifest.json", "manifest.json"), (".fleet-verified.json", "dot-files"),
     ("sub/.x", "dot-files")],
)
def test_a_manifest_cannot_name_a_file_outside_its_folder_or_the_caches_own(path: str, rule: str) -> None:
    m = _manifest()
    doc = m.model_dump()
    doc["files"] = [*doc["files"], {"path": path, "role": "tokenizer", "sha256": SHA_A, "size_bytes": 1}]
    doc["total_bytes"] += 1
    with pytest.raises(ModelLoadError) as err:
        decode_manifest(json.dumps(doc).encode(), "s3://b/m/v/manifest.json")
    assert rule in str(err.value) and err.value.field == "manifest.json"


@pytest.mark.parametrize(
    ("change", "words"),
    [({"total_bytes": 5}, "total_bytes"), ({"model_file": "other.onnx"}, "model_file"),
     ({"schema_version": 2}, "schema_version"), ({"version": "a/b"}, "version"),
     ({"files": [{"path": "m.onnx", "role": "model", "sha256": "XYZ", "size_bytes": 1}]}, "sha256")],
)
def test_invalid_manifests_raise_model_load_error_naming_the_key(change: dict[str, Any], words: str) -> None:
    doc = {**_manifest().model_dump(), **change}
    with pytest.raises(ModelLoadError) as err:
        decode_manifest(json.dumps(doc).encode(), "where")
    assert words in str(err.value)


def test_not_json_is_a_model_load_error() -> None:
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        decode_manifest(b"{nope", "where")


def test_versions_sort_naturally() -> None:
    names = ["1.10.0", "1.2.0", "1.2.0-int8", "1.9.1", "2.0.0"]
    assert sorted(names, key=version_sort_key) == ["1.2.0", "1.2.0-int8", "1.9.1", "1.10.0", "2.0.0"]


# -- the `store` settings -----------------------------------------------------------------------------


def test_store_defaults_to_none_with_a_cache_folder() -> None:
    s = StoreSettings()
    assert s.backend == "none" and str(s.cache_dir) == "var/model-cache" and not s.reverify_cached


@pytest.mark.parametrize(
    ("section", "words"),
    [({"backend": "s3"}, "store.bucket"), ({"backend": "local"}, "store.root"),
     ({"backend": "s3", "bucket": "b", "endpoint_url": "localhost:8333"}, "endpoint_url")],
)
def test_store_backends_need_their_settings(section: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        load_settings("/dev/null", store=section)


@pytest.mark.parametrize("key", ["secret_key", "aws_access_key_id", "access_key", "session_token", "credentials"])
def test_credentials_are_never_taken_from_the_settings(key: str) -> None:
    with pytest.raises(ConfigError, match="never read from the settings") as err:
        load_settings("/dev/null", store={"backend": "s3", "bucket": "models", key: "x"})
    assert "AWS_ACCESS_KEY_ID" in str(err.value)


def test_store_version_needs_a_store_and_then_no_path() -> None:
    with pytest.raises(ConfigError, match=r"store_version is set but store\.backend is 'none'"):
        load_settings("/dev/null", models={"m": {"store_version": "1.2.3"}})
    s: FleetSettings = load_settings(
        "/dev/null", store={"backend": "local", "root": "/srv/models"}, models={"m": {"store_version": "1.2.3"}}
    )
    assert s.models["m"].store_version == "1.2.3"
    assert not s.models["m"].path.exists()  # a placeholder: producers read the card a worker publishes


def test_a_yaml_model_with_a_store_version_and_no_path(tmp_path: Path) -> None:
    config = tmp_path / "fleet.yaml"
    config.write_text("store: {backend: local, root: /srv/models}\n"
                      "models: {a: {store_version: 1.0.0}, b: {store_version: 2.0.0, path: null}}\n")
    s = load_settings(config)
    assert all(not m.path.exists() and "store:" in str(m.path) for m in s.models.values())


def test_store_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_STORE__BACKEND", "s3")
    monkeypatch.setenv("FLEET_STORE__BUCKET", "fleet-models")
    monkeypatch.setenv("FLEET_STORE__ENDPOINT_URL", "http://127.0.0.1:8333")
    monkeypatch.setenv("FLEET_MODELS__DEMO_LM__STORE_VERSION", "2.0.0")
    s = load_settings("/dev/null")
    assert (s.store.backend, s.store.bucket, s.store.endpoint_url) == ("s3", "fleet-models", "http://127.0.0.1:8333")
    assert s.model("demo-lm").store_version == "2.0.0"
