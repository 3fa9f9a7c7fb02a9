"""``fleet models push --takeover`` while an upload of the push it replaces is already in flight.

The fence (``test_store_takeover_fence.py``) stops a taken-over push at its next step; it cannot recall an
upload that passed its fence read before the takeover came. Here push A's upload of the model file is held
in flight (past its fence, not landed) until the test lets it land, and push B takes A over meanwhile, on a
real local store with two model folders whose files differ:

* A's upload lands after B's upload of that file (B has published): before, it replaced B's file and the
  published version failed every fetch with ChecksumMismatch. Now A's exclusive upload is refused and A
  stops; the version is B's, intact.
* A's upload lands after B cleared the version, before B's upload of that file: B's exclusive upload is
  refused, B stops naming the file and writes no manifest; the version stays unfinished until B's retry.

``race_*`` take the held backend from a factory, so the S3 test (``tests/integration/
test_store_takeover_inflight_s3.py``) runs the same interleavings with the upload held inside boto3.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from store import ModelStore, VersionExists, VersionNotFound
from store.backend import Backend, Progress
from store.local import LocalBackend
from store.publish import CLAIM_NAME, publish
from tests.unit.test_store_takeover_fence import WAIT_S, _check_published_intact, _two_folders

MODEL_FILE = "tiny-1.0.0.onnx"
"""The file whose upload is held: its bytes differ between push A's folder and push B's."""


class Gate:
    """One upload held in flight: :attr:`held` is set once it is, :attr:`go` lets it land."""

    def __init__(self) -> None:
        self.held = threading.Event()
        self.go = threading.Event()

    def hold(self) -> None:
        """Called on the uploading thread: park there until the test sets :attr:`go`."""
        self.held.set()
        assert self.go.wait(WAIT_S), "the test never let the upload land"


class HoldBeforeUpload:
    """A backend (one push's view of it) whose first upload of ``key`` waits at ``gate`` before it starts:
    the push has passed its fence read, nothing of the file has landed; everything else passes through."""

    def __init__(self, inner: Backend, key: str, gate: Gate) -> None:
        self.inner = inner
        self.key = key
        self.gate = gate

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def upload(self, key: str, source: Path, progress: Progress | None = None, *, exclusive: bool = False) -> int:
        if key == self.key and not self.gate.held.is_set():
            self.gate.hold()
        return self.inner.upload(key, source, progress, exclusive=exclusive)


HeldBackend = Callable[[str, Gate], Backend]
"""``(key, gate)`` → push A's backend, whose upload of ``key`` is held in flight at ``gate``."""


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=2) as executor:
        yield executor


def race_late_landing(
    pool: ThreadPoolExecutor, backend: Backend, held_backend: HeldBackend, tmp_path: Path, version: str
) -> None:
    """A's upload of the model file is held; B takes over and publishes; A's upload then lands (or not)."""
    path_a, path_b, _ = _two_folders(backend, tmp_path)
    key = f"tiny/{version}/{MODEL_FILE}"
    gate_a = Gate()
    push_a = pool.submit(publish, held_backend(key, gate_a), path_a, "tiny", version)
    assert gate_a.held.wait(WAIT_S), f"push A never uploaded {key}"
    store = ModelStore(backend, tmp_path / "cache")
    manifest_b = store.push(path_b, "tiny", version, takeover=True)
    gate_a.go.set()
    failure_a = push_a.exception(timeout=WAIT_S)

    # before: ChecksumMismatch (A's model bytes under B's published manifest)
    _check_published_intact(store, backend, manifest_b, version)
    assert isinstance(failure_a, VersionExists), f"push A: {failure_a!r}"
    assert "taken over by another" in str(failure_a) and f"its upload of {MODEL_FILE} was refused" in str(failure_a)


def race_landing_before_the_takeovers_upload(
    pool: ThreadPoolExecutor, backend: Backend, held_backend: HeldBackend, tmp_path: Path, version: str
) -> None:
    """A's upload of the model file is held; B takes over, clears the version and is held before its own
    upload of that file; A's lands; B's is refused: B stops, no manifest; B's retry publishes."""
    path_a, path_b, _ = _two_folders(backend, tmp_path)
    key = f"tiny/{version}/{MODEL_FILE}"
    gate_a, gate_b = Gate(), Gate()
    push_a = pool.submit(publish, held_backend(key, gate_a), path_a, "tiny", version)
    assert gate_a.held.wait(WAIT_S), f"push A never uploaded {key}"
    push_b = pool.submit(publish, HoldBeforeUpload(backend, key, gate_b), path_b, "tiny", version, takeover=True)
    assert gate_b.held.wait(WAIT_S), f"push B never uploaded {key}"
    gate_a.go.set()
    failure_a = push_a.exception(timeout=WAIT_S)
    gate_b.go.set()
    failure_b = push_b.exception(timeout=WAIT_S)

    assert isinstance(failure_a, VersionExists) and "taken over by another" in str(failure_a), repr(failure_a)
    # before: B uploaded over A's late file and published (right here, by luck of the order)
    assert isinstance(failure_b, VersionExists), f"push B: {failure_b!r}"
    assert failure_b.field == MODEL_FILE and failure_b.limit == version
    assert "is still writing" in str(failure_b) and "retry with takeover" in str(failure_b)
    assert not backend.exists(f"tiny/{version}/manifest.json")
    store = ModelStore(backend, tmp_path / "cache")
    with pytest.raises(VersionNotFound):
        store.fetch("tiny", version)
    manifest_b = store.push(path_b, "tiny", version, takeover=True)  # A has stopped: the retry publishes
    _check_published_intact(store, backend, manifest_b, version)


def _held_local(local: LocalBackend) -> HeldBackend:
    return lambda key, gate: HoldBeforeUpload(local, key, gate)


def test_an_in_flight_upload_landing_after_the_takeover_is_refused(tmp_path: Path, pool: ThreadPoolExecutor) -> None:
    local = LocalBackend(tmp_path / "store")
    race_late_landing(pool, local, _held_local(local), tmp_path, "1.0.0")


def test_a_takeover_stops_when_the_replaced_push_lands_a_file_first(
    tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    local = LocalBackend(tmp_path / "store")
    race_landing_before_the_takeovers_upload(pool, local, _held_local(local), tmp_path, "1.0.0")


@pytest.mark.parametrize("takeover", [True, False], ids=["takeover-of-a-dead-push", "claim-removed-by-hand"])
def test_files_a_dead_push_left_are_cleared_before_the_exclusive_uploads(tmp_path: Path, takeover: bool) -> None:
    """A dead push left a file (and its claim, or none: removed by hand); a new push still publishes."""
    local = LocalBackend(tmp_path / "store")
    _, path_b, _ = _two_folders(local, tmp_path)
    if takeover:
        local.write(f"tiny/1.0.0/{CLAIM_NAME}", b'{"by": "ghost@gone"}', exclusive=True)
    local.write(f"tiny/1.0.0/{MODEL_FILE}", b"half a model")
    store = ModelStore(local, tmp_path / "cache")
    manifest = store.push(path_b, "tiny", "1.0.0", takeover=takeover)
    _check_published_intact(store, local, manifest, "1.0.0")
