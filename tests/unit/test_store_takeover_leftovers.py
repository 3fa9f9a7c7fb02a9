"""A takeover (or any publish of an unfinished version) leaves under the version only what its manifest names.

Before, a push cleared only the names of its own files: a dead push's files under other names (a tokenizer the
new folder lacks, external data, a local store's half-written temporary file) stayed under the published
version, unreferenced, for ever. Now every object under ``<model>/<version>/`` but the claim is removed before
the uploads, and what the manifest does not name is removed again right before the manifest is written (a file
of the replaced push that landed meanwhile). On a real local store here; ``tests/integration/
test_store_takeover_leftovers_s3.py`` runs the same functions on SeaweedFS.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from store import ModelStore, StoreError, VersionExists
from store.backend import Backend
from store.local import LocalBackend
from store.manifest import MANIFEST_NAME
from store.publish import CLAIM_NAME, publish
from tests.unit.test_store_takeover_fence import WAIT_S, _check_published_intact, _two_folders
from tests.unit.test_store_takeover_inflight import Gate, HeldBackend, HoldBeforeUpload

EXTRA = "tokenizer_config.json"
"""A file push A's folder has and push B's lacks."""


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=2) as executor:
        yield executor


def _only_the_manifests_files(backend: Backend, version: str) -> None:
    """The version's folder holds its manifest's files and the manifest, nothing else."""
    store_manifest = ModelStore(backend, Path("/nonexistent")).manifest("tiny", version)
    expected = sorted([f"tiny/{version}/{f.path}" for f in store_manifest.files] + [f"tiny/{version}/{MANIFEST_NAME}"])
    assert backend.keys(f"tiny/{version}/") == expected


def leftovers_of_a_dead_push(backend: Backend, tmp_path: Path, version: str, *, takeover: bool,
                             temp_name: str | None) -> None:  # fmt: skip
    """A dead push left files under names the new push does not have (and its claim, or none: removed by hand)."""
    _, path_b, _ = _two_folders(backend, tmp_path)
    prefix = f"tiny/{version}/"
    if takeover:
        backend.write(prefix + CLAIM_NAME, b'{"by": "ghost@gone"}', exclusive=True)
    left = [EXTRA, "tiny-1.0.0.onnx.data", "sub/config.json", *([temp_name] if temp_name else [])]
    for rel in left:
        backend.write(prefix + rel, b"left by a push that died")
    store = ModelStore(backend, tmp_path / "cache")
    manifest = store.push(path_b, "tiny", version, takeover=takeover)
    _check_published_intact(store, backend, manifest, version)
    _only_the_manifests_files(backend, version)  # before: the four files above were still there


def race_extra_file_landing_mid_takeover(
    pool: ThreadPoolExecutor, backend: Backend, held_backend: HeldBackend, tmp_path: Path, version: str
) -> None:
    """A's upload of a file B does not have is held; B takes over, clears the version and is held before its
    first upload; A's file lands (its name is free: the exclusive upload passes) and A stops at its next fence;
    B goes on and publishes with A's file gone."""
    path_a, path_b, order = _two_folders(backend, tmp_path)
    (path_a.parent / EXTRA).write_text('{"chat_template": "{{ messages }}"}')
    prefix = f"tiny/{version}/"
    gate_a, gate_b = Gate(), Gate()
    push_a = pool.submit(publish, held_backend(prefix + EXTRA, gate_a), path_a, "tiny", version)
    assert gate_a.held.wait(WAIT_S), f"push A never uploaded {EXTRA}"
    push_b = pool.submit(publish, HoldBeforeUpload(backend, prefix + order[0], gate_b), path_b, "tiny", version,
                         takeover=True)  # fmt: skip
    assert gate_b.held.wait(WAIT_S), "push B never uploaded"
    gate_a.go.set()
    failure_a = push_a.exception(timeout=WAIT_S)
    assert isinstance(failure_a, VersionExists) and "taken over by another" in str(failure_a), repr(failure_a)
    assert backend.exists(prefix + EXTRA)  # A's file landed after B cleared the version
    gate_b.go.set()
    manifest_b = push_b.result(timeout=WAIT_S)
    assert EXTRA not in {f.path for f in manifest_b.files}
    _check_published_intact(ModelStore(backend, tmp_path / "cache"), backend, manifest_b, version)
    _only_the_manifests_files(backend, version)  # before: A's tokenizer_config.json stayed, unreferenced


@pytest.mark.parametrize("takeover", [True, False], ids=["takeover-of-a-dead-push", "claim-removed-by-hand"])
def test_a_dead_push_leaves_nothing_under_the_published_version(tmp_path: Path, takeover: bool) -> None:
    local = LocalBackend(tmp_path / "store")
    leftovers_of_a_dead_push(local, tmp_path, "1.0.0", takeover=takeover, temp_name=".tiny-1.0.0.onnx.x1y2.tmp")


def test_a_file_the_replaced_push_lands_mid_takeover_is_removed(tmp_path: Path, pool: ThreadPoolExecutor) -> None:
    local = LocalBackend(tmp_path / "store")
    race_extra_file_landing_mid_takeover(pool, local, lambda key, gate: HoldBeforeUpload(local, key, gate), tmp_path,
                                         "1.0.0")  # fmt: skip


def test_a_temp_file_cleared_under_a_replaced_push_stops_it_with_a_store_error(tmp_path: Path) -> None:
    """A local upload whose temporary file a takeover's clearing removed while it was written says so (before: a
    bare FileNotFoundError out of the push)."""
    local = LocalBackend(tmp_path / "store")
    source = tmp_path / "f.bin"
    source.write_bytes(b"x" * 10)

    def takeover_clears(_n: int) -> None:
        for key in local.keys("tiny/"):  # the temporary file being written, among them
            local.delete(key)

    with pytest.raises(StoreError) as failed:
        local.upload("tiny/1.0.0/f.bin", source, takeover_clears, exclusive=True)
    assert "another push (a takeover) cleared the version" in str(failed.value)
    assert failed.value.field == "tiny/1.0.0/f.bin"
    assert local.keys("tiny/") == []
