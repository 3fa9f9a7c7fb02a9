"""``fleet models push --takeover`` while the push it replaces is still running (not dead).

A real local store, two real pushes of one version from two model folders whose files differ, on
threads: a push is held right after one of its uploads lands (the wrapper below parks it there until the
test lets it go), so the test sets the interleaving. Before the fence, push A went on uploading over the
files B had published, or wrote its manifest over files B had begun to upload: a torn version that every
fetch refused with ChecksumMismatch. Now A stops at its next step with VersionExists and the version is B's.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import onnx
import pytest
from onnx import numpy_helper

from store import Manifest, ModelStore, VersionExists
from store.backend import Backend, Progress
from store.files import hash_file
from store.local import LocalBackend
from store.publish import CLAIM_NAME, publish
from tests.unit.test_store_local import _write_model

WAIT_S = 30.0


class ParkAfterUpload:
    """A backend (one push's view of it) whose ``upload`` of ``park_key`` parks once it has landed,
    until :attr:`go` is set; everything else passes straight through."""

    def __init__(self, inner: Backend, park_key: str) -> None:
        self.inner = inner
        self.park_key = park_key
        self.parked = threading.Event()
        self.go = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def upload(self, key: str, source: Path, progress: Progress | None = None, *, exclusive: bool = False) -> int:
        stored = self.inner.upload(key, source, progress, exclusive=exclusive)
        if key == self.park_key:
            self.parked.set()
            assert self.go.wait(WAIT_S), "the test never let the push go on"
        return stored


def _folder(root: Path, eos: int, weight_scale: float) -> Path:
    """A model folder (model, card, generation_config.json); the model's weights and the config differ per call."""
    path = _write_model(root, "tiny-1.0.0")
    proto = onnx.load(str(path))
    weight = proto.graph.initializer[0]
    weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight) * weight_scale + 1, weight.name))
    onnx.save_model(proto, str(path))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return path


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=2) as executor:
        yield executor


def _parked_push(
    pool: ThreadPoolExecutor, backend: ParkAfterUpload, path: Path, *, takeover: bool, version: str = "1.0.0"
) -> Future[Any]:
    """``publish`` on a pool thread, returned once it is parked after ``backend.park_key`` landed."""
    future = pool.submit(publish, backend, path, "tiny", version, takeover=takeover)
    assert backend.parked.wait(WAIT_S), f"the push never uploaded {backend.park_key}"
    return future


def _upload_order(local: Backend, path: Path, tmp_path: Path) -> list[str]:
    """The files of ``path`` in the order a push uploads them (the manifest's), read off a throwaway version."""
    return [f.path for f in ModelStore(local, tmp_path / "probe").push(path, "probe", uuid.uuid4().hex[:8]).files]


def _check_published_intact(store: ModelStore, local: Backend, manifest: Manifest | None, version: str) -> None:
    """The version fetches (every file matches the published manifest), and that manifest is ``manifest``."""
    # before the fence: ChecksumMismatch (one push's bytes under the other's manifest)
    fetched = store.fetch("tiny", version)
    assert store.manifest("tiny", version) == manifest
    for entry in store.manifest("tiny", version).files:
        assert hash_file(fetched.parent / entry.path)[0] == entry.sha256
    assert not local.exists(f"tiny/{version}/{CLAIM_NAME}")


def _two_folders(backend: Backend, tmp_path: Path) -> tuple[Path, Path, list[str]]:
    """Push A's and push B's model folders (their files differ), and the order a push uploads them in."""
    path_a = _folder(tmp_path / "a", eos=2, weight_scale=1.0)
    path_b = _folder(tmp_path / "b", eos=3, weight_scale=-1.0)
    return path_a, path_b, _upload_order(backend, path_a, tmp_path)


def race_at_commit(pool: ThreadPoolExecutor, backend: Backend, tmp_path: Path, version: str) -> None:
    """A parked after its last upload; B takes over and is parked after its first; A, let go, would
    publish its manifest over B's first file. B, let go, publishes; the version is B's, intact."""
    path_a, path_b, order = _two_folders(backend, tmp_path)
    backend_a = ParkAfterUpload(backend, f"tiny/{version}/{order[-1]}")
    backend_b = ParkAfterUpload(backend, f"tiny/{version}/{order[0]}")

    push_a = _parked_push(pool, backend_a, path_a, takeover=False, version=version)
    push_b = _parked_push(pool, backend_b, path_b, takeover=True, version=version)
    backend_a.go.set()
    failure_a = push_a.exception(timeout=WAIT_S)
    backend_b.go.set()
    failure_b = push_b.exception(timeout=WAIT_S)

    manifest_b = None if failure_b else push_b.result()
    _check_published_intact(ModelStore(backend, tmp_path / "cache"), backend, manifest_b, version)
    assert failure_b is None, f"push B failed: {failure_b!r}"
    assert isinstance(failure_a, VersionExists) and "stopped before writing its manifest" in str(failure_a)


def test_a_taken_over_push_uploads_nothing_more(tmp_path: Path, pool: ThreadPoolExecutor) -> None:
    """A parked after its first upload; B takes over and publishes; A, let go, would upload its other
    files over B's published ones."""
    local = LocalBackend(tmp_path / "store")
    path_a, path_b, order = _two_folders(local, tmp_path)
    store = ModelStore(local, tmp_path / "cache")
    backend_a = ParkAfterUpload(local, f"tiny/1.0.0/{order[0]}")

    push_a = _parked_push(pool, backend_a, path_a, takeover=False)
    manifest_b = store.push(path_b, "tiny", "1.0.0", takeover=True)
    backend_a.go.set()
    failure_a = push_a.exception(timeout=WAIT_S)

    _check_published_intact(store, local, manifest_b, "1.0.0")
    assert isinstance(failure_a, VersionExists) and failure_a.field == "version"
    assert f"stopped before uploading {order[1]}" in str(failure_a) and "taken over by another" in str(failure_a)


def test_a_taken_over_push_never_writes_its_manifest(tmp_path: Path, pool: ThreadPoolExecutor) -> None:
    race_at_commit(pool, LocalBackend(tmp_path / "store"), tmp_path, "1.0.0")


def test_a_push_whose_claim_vanished_stops_before_its_manifest(tmp_path: Path, pool: ThreadPoolExecutor) -> None:
    """The claim deleted by hand (someone cleaning up a "dead" push) fences the live push too: it would
    otherwise publish with nobody's claim in place while a takeover may be uploading."""
    local = LocalBackend(tmp_path / "store")
    path_a, _, order = _two_folders(local, tmp_path)
    backend_a = ParkAfterUpload(local, f"tiny/1.0.0/{order[-1]}")
    push_a = _parked_push(pool, backend_a, path_a, takeover=False)
    local.delete(f"tiny/1.0.0/{CLAIM_NAME}")
    backend_a.go.set()
    with pytest.raises(VersionExists, match="stopped before writing its manifest"):
        push_a.result(timeout=WAIT_S)
    assert not local.exists("tiny/1.0.0/manifest.json")
