"""The model store on a local directory: publish, list, verified fetch, the cache, the worker's hook.

Tiny ONNX graphs written here (one ``Add`` with a weight), so these run in milliseconds; the same
code paths against a real S3 server are in ``tests/integration/test_model_store.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from protocol.errors import InvalidRequest, ModelLoadError
from protocol.settings import load_settings
from store import ChecksumMismatch, ModelStore, VersionExists, VersionNotFound, resolve_model
from store.backend import Progress
from store.fetch import MARKER_NAME, process_token
from store.local import LocalBackend
from store.publish import CLAIM_NAME


def _write_model(folder: Path, stem: str, *, external: bool = False, tokenizer: str = "byte") -> Path:
    """``<folder>/<stem>.onnx`` (y = x + W) and its card; with ``external`` W lives in ``<stem>.data``."""
    folder.mkdir(parents=True, exist_ok=True)
    weight = numpy_helper.from_array(np.arange(8, dtype=np.float32), "W")
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "W"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8])], [weight],
    )
    proto = helper.make_model(graph)
    path = folder / f"{stem}.onnx"
    if external:
        onnx.save_model(proto, str(path), save_as_external_data=True, location=f"{stem}.data", size_threshold=0)
    else:
        onnx.save_model(proto, str(path))
    card = {"name": stem, "version": "1.0.0", "kind": "causal_lm", "vocab_size": 512, "max_positions": 64,
            "num_layers": 0, "num_heads": 1, "head_dim": 8, "hidden_size": 8, "tokenizer": tokenizer}
    path.with_suffix(".json").write_text(json.dumps(card))
    return path


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """A model folder as builders and exports leave it: the model, shared HF files, and things that
    belong to something else (another model and its card, notes)."""
    path = _write_model(tmp_path / "src", "tiny-1.0.0")
    (path.parent / "generation_config.json").write_text('{"eos_token_id": 2}')
    (path.parent / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    (path.parent / "tiny-1.0.0.report.json").write_text("{}")
    _write_model(tmp_path / "src", "other-2.0.0")
    (path.parent / "notes.txt").write_text("not part of the model")
    return path


class Recording:
    """A backend wrapper that logs writes and counts downloads."""

    def __init__(self, inner: LocalBackend) -> None:
        self.inner = inner
        self.writes: list[str] = []
        self.downloads = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def write(self, key: str, data: bytes, *, exclusive: bool = False) -> None:
        self.inner.write(key, data, exclusive=exclusive)
        self.writes.append(key)

    def upload(self, key: str, source: Path, progress: Progress | None = None, *, exclusive: bool = False) -> int:
        self.writes.append(key)
        return self.inner.upload(key, source, progress, exclusive=exclusive)

    def download(self, key: str, dest: Path, progress: Progress | None = None) -> None:
        self.downloads += 1
        self.inner.download(key, dest, progress)


@pytest.fixture
def rec(tmp_path: Path) -> Recording:
    return Recording(LocalBackend(tmp_path / "store"))


@pytest.fixture
def store(rec: Recording, tmp_path: Path) -> ModelStore:
    return ModelStore(rec, tmp_path / "cache")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_push_takes_the_models_files_only_and_writes_the_manifest_last(
    store: ModelStore, rec: Recording, model: Path, tmp_path: Path
) -> None:
    m = store.push(model, "tiny", "1.2.3", created_by="tester@here")
    assert sorted(f.path for f in m.files) == [
        "generation_config.json", "tiny-1.0.0.json", "tiny-1.0.0.onnx", "tiny-1.0.0.report.json",
        "tokenizer_config.json",
    ]
    roles = {f.path: f.role for f in m.files}
    assert roles["tiny-1.0.0.onnx"] == "model" and roles["tiny-1.0.0.report.json"] == "report"
    assert rec.writes[0] == f"tiny/1.2.3/{CLAIM_NAME}" and rec.writes[-1] == "tiny/1.2.3/manifest.json"
    folder = tmp_path / "store" / "tiny" / "1.2.3"
    assert sorted(p.name for p in folder.iterdir()) == sorted([f.path for f in m.files] + ["manifest.json"])
    for f in m.files:
        assert f.sha256 == _sha(model.parent / f.path) and f.size_bytes == (model.parent / f.path).stat().st_size
    assert (m.precision, m.kind, m.created_by) == ("fp32", "causal_lm", "tester@here")


def test_external_data_and_a_cards_tokenizer_file_travel_with_the_model(store: ModelStore, tmp_path: Path) -> None:
    path = _write_model(tmp_path / "ext", "big-1.0.0", external=True, tokenizer="big.tokenizer.json")
    (path.parent / "big.tokenizer.json").write_text("{}")
    m = store.push(path.parent, "big", "1.0.0")  # a folder with exactly one model is fine
    assert {f.path: f.role for f in m.files}["big-1.0.0.data"] == "external_data"
    assert {f.path: f.role for f in m.files}["big.tokenizer.json"] == "tokenizer"
    fetched = store.fetch("big", "1.0.0")
    loaded = onnx.load(str(fetched))  # external data found beside the cached file
    assert numpy_helper.to_array(loaded.graph.initializer[0]).tolist() == list(range(8))


def test_a_published_version_is_never_overwritten(store: ModelStore, model: Path) -> None:
    first = store.push(model, "tiny", "1.2.3")
    with pytest.raises(VersionExists) as err:
        store.push(model, "tiny", "1.2.3")
    assert "tiny 1.2.3 is already published" in str(err.value) and err.value.limit == "1.2.3"
    assert store.manifest("tiny", "1.2.3") == first


def test_an_unfinished_push_holds_its_claim_until_taken_over(store: ModelStore, rec: Recording, model: Path) -> None:
    rec.inner.write(f"tiny/2.0.0/{CLAIM_NAME}", b'{"by": "ghost@gone"}', exclusive=True)
    assert store.versions("tiny") == [{"version": "2.0.0", "state": "unfinished"}]
    with pytest.raises(VersionExists, match="ghost@gone"):
        store.push(model, "tiny", "2.0.0")
    with pytest.raises(VersionNotFound, match="claimed it but not finished"):
        store.fetch("tiny", "2.0.0")
    store.push(model, "tiny", "2.0.0", takeover=True)
    assert [v["state"] for v in store.versions("tiny")] == ["published"]
    assert not rec.inner.exists(f"tiny/2.0.0/{CLAIM_NAME}")


def test_list_and_show(store: ModelStore, model: Path) -> None:
    for version in ("1.10.0", "1.2.0", "1.9.0"):
        store.push(model, "tiny", version)
    assert store.models() == ["tiny"]
    listed = store.versions("tiny")
    assert [v["version"] for v in listed] == ["1.2.0", "1.9.0", "1.10.0"]
    assert all(v["state"] == "published" and len(v["manifest_sha256"]) == 64 for v in listed)
    assert store.manifest("tiny", "1.9.0").version == "1.9.0"


def test_fetch_verifies_then_reuses_the_cache_without_the_store(
    store: ModelStore, rec: Recording, model: Path, tmp_path: Path
) -> None:
    store.push(model, "tiny", "1.2.3")
    path = store.fetch("tiny", "1.2.3")
    assert path == tmp_path / "cache" / "tiny" / "1.2.3" / "tiny-1.0.0.onnx"
    assert path.read_bytes() == model.read_bytes() and (path.parent / MARKER_NAME).is_file()
    downloads = rec.downloads
    (tmp_path / "store").rename(tmp_path / "store-gone")  # the store is unreachable now
    assert store.fetch("tiny", "1.2.3") == path and rec.downloads == downloads


def test_a_corrupted_object_is_refused_naming_the_file_and_both_checksums(
    store: ModelStore, model: Path, tmp_path: Path
) -> None:
    store.push(model, "tiny", "1.2.3")
    expected = _sha(model)
    stored = tmp_path / "store" / "tiny" / "1.2.3" / "tiny-1.0.0.onnx"
    stored.write_bytes(stored.read_bytes()[:-1] + b"\x00")
    with pytest.raises(ChecksumMismatch) as err:
        store.fetch("tiny", "1.2.3")
    message = str(err.value)
    assert "tiny-1.0.0.onnx" in message and expected in message and _sha(stored) in message
    assert isinstance(err.value, ModelLoadError) and err.value.field == "tiny-1.0.0.onnx"
    assert list((tmp_path / "cache" / "tiny").iterdir()) == []  # nothing half-verified left behind


def test_a_damaged_cache_is_fetched_again(store: ModelStore, rec: Recording, model: Path) -> None:
    store.push(model, "tiny", "1.2.3")
    path = store.fetch("tiny", "1.2.3")
    path.write_bytes(b"truncated")  # size no longer the manifest's: caught by the cheap check
    downloads = rec.downloads
    assert store.fetch("tiny", "1.2.3") == path and path.read_bytes() == model.read_bytes()
    assert rec.downloads > downloads


def test_reverify_rehashes_what_the_cheap_check_trusts(store: ModelStore, rec: Recording, model: Path) -> None:
    store.push(model, "tiny", "1.2.3")
    path = store.fetch("tiny", "1.2.3")
    raw = path.read_bytes()
    path.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))  # same size, other bytes
    assert store.fetch("tiny", "1.2.3") == path and path.read_bytes() != raw  # marker + sizes trusted
    store.reverify_cached = True
    assert store.fetch("tiny", "1.2.3") == path and path.read_bytes() == raw


def test_a_manifest_pinned_by_digest_must_match(store: ModelStore, model: Path, tmp_path: Path) -> None:
    store.push(model, "tiny", "1.2.3")
    digest = hashlib.sha256(store.manifest_bytes("tiny", "1.2.3")).hexdigest()
    assert store.fetch("tiny", "1.2.3", tmp_path / "c1", manifest_sha256=digest).is_file()
    pinned = f"changed since it was pinned \\(sha256 {'0' * 64} pinned, {digest} now, .*manifest.json"
    with pytest.raises(ChecksumMismatch, match=pinned):
        store.fetch("tiny", "1.2.3", tmp_path / "c2", manifest_sha256="0" * 64)


def test_leftovers_of_a_dead_fetch_are_swept(store: ModelStore, model: Path, tmp_path: Path) -> None:
    store.push(model, "tiny", "1.2.3")
    dead = tmp_path / "cache" / "tiny" / ".1.2.3.partial-999999999-abc"
    dead.mkdir(parents=True)
    store.fetch("tiny", "1.2.3")
    assert not dead.exists()


def test_unknown_versions_and_bad_paths(store: ModelStore, model: Path) -> None:
    with pytest.raises(VersionNotFound, match=r"tiny 9\.9\.9 is not published"):
        store.fetch("tiny", "9.9.9")
    with pytest.raises(InvalidRequest, match="2 ONNX files"):
        store.push(model.parent, "tiny", "1.0.0")
    with pytest.raises(InvalidRequest, match="not a valid name"):
        store.push(model, "tiny", "../1")


def test_the_worker_hook_resolves_a_store_version_to_the_verified_copy(
    store: ModelStore, model: Path, tmp_path: Path
) -> None:
    store.push(model, "tiny", "1.2.3")
    settings = load_settings(
        "/dev/null",
        store={"backend": "local", "root": str(tmp_path / "store"), "cache_dir": str(tmp_path / "wcache")},
        models={"tiny": {"store_version": "1.2.3"}, "plain": {"path": str(model)}},
    )
    resolved = resolve_model(settings, "tiny")
    assert resolved.path == tmp_path / "wcache" / "tiny" / "1.2.3" / "tiny-1.0.0.onnx"
    assert resolved.version == "1.2.3" and resolved.path.is_file()
    assert resolve_model(settings, "plain") is settings.models["plain"]  # no store version: untouched
    assert os.path.samefile(resolve_model(settings, "tiny", version="1.2.3").path, resolved.path)


def test_leftovers_of_an_earlier_process_with_this_pid_are_swept(
    store: ModelStore, model: Path, tmp_path: Path
) -> None:
    """A worker restarted in a container gets the pid of the one that died there; its leftovers are swept. Before,
    a folder named by the pid alone looked like this process's own fetch in progress and was kept for good."""
    store.push(model, "tiny", "1.2.3")
    folder = tmp_path / "cache" / "tiny"
    own = process_token()
    earlier = folder / f".1.2.3.partial-{os.getpid()}_1-abc"  # this pid, started at another time
    running = folder / f".1.2.3.partial-{own}-def"  # this very process (another thread's fetch)
    for leftover in (earlier, running):
        leftover.mkdir(parents=True)
    store.fetch("tiny", "1.2.3")
    assert not earlier.exists() and running.exists()
    assert own.split("_")[1].isdigit()  # Linux: the start time is known
