"""Superseded loads: the reconciler's bookkeeping (at most one current and one abandoned load per role) and
the store fetch that stops between files once its ``stop`` event is set (a real local store, real files)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from store import ModelStore
from store.backend import Progress
from store.fetch import Stopped
from store.local import LocalBackend
from tests.unit.test_store_local import _write_model
from workers.version_loads import VersionLoads


def test_a_superseded_load_frees_its_role_and_a_third_waits_for_one_of_two_to_end() -> None:
    loads = VersionLoads("worker w", "m")
    first = loads.begin("stable", "v1")
    loads.supersede(lambda role, version: version == "v1", 1)  # still named: nothing changes
    assert not first.superseded and loads.versions() == {"stable": "v1"}

    loads.supersede(lambda role, version: version == "v2", 2)  # the state moved on to v2
    assert first.superseded and loads.abandoned == {"stable": first} and loads.versions() == {}
    second = loads.begin("stable", "v2")  # the replacement does not wait for the superseded load
    with pytest.raises(RuntimeError, match="stable load of v2 is in flight"):
        loads.begin("stable", "v9")

    loads.supersede(lambda role, version: version == "v3", 3)  # superseded too: the abandoned slot is taken
    assert second.superseded and loads.current == {"stable": second} and loads.waits("stable") is first
    assert loads.versions() == {"stable": "v2"}  # so to_start begins no third stable load

    loads.end(first)  # the older one ended: the next pass abandons the second and frees the role
    loads.supersede(lambda role, version: version == "v3", 3)
    assert loads.abandoned == {"stable": second} and loads.versions() == {} and loads.waits("stable") is None
    canary = loads.begin("canary", "c1")  # the other role is never held up
    assert loads.versions() == {"canary": "c1"} and loads.abandoned == {"stable": second}

    loads.stop_all()
    assert canary.superseded
    loads.end(second)
    loads.end(canary)
    assert loads.current == {} and loads.abandoned == {}


@pytest.mark.parametrize("stop_after", ["the manifest", "the first file"])
def test_a_stopped_fetch_leaves_nothing_in_the_cache(tmp_path: Path, stop_after: str) -> None:
    model = _write_model(tmp_path / "src", "tiny-1.0.0", external=True)  # three files: card, graph, weights
    store = ModelStore(LocalBackend(tmp_path / "store"), tmp_path / "cache")
    manifest = store.push(model, "tiny", "1.2.3")
    stop = threading.Event()
    if stop_after == "the manifest":
        stop.set()

    @contextmanager
    def bar(_description: str, _total: int) -> Iterator[Progress]:
        yield lambda _n: stop.set()  # bytes of the first file arrived: the caller stops wanting the version

    with pytest.raises(Stopped) as stopped:
        store.fetch("tiny", "1.2.3", progress=bar, stop=stop)
    first = manifest.files[0].path
    assert stopped.value.step == ("the manifest" if stop_after == "the manifest" else first)
    folder = tmp_path / "cache" / "tiny"
    assert not folder.exists() or list(folder.iterdir()) == []  # no partial folder, no version

    stop.clear()
    assert store.fetch("tiny", "1.2.3", stop=stop).is_file()  # not stopped: fetched and installed
