"""``broker/`` is the one seam to kombu's and Celery's internals: the rest of the fleet imports only the names
of ``broker.__all__`` (never a submodule), ``broker/`` imports nothing above it, ``protocol/`` nothing of it,
and kombu's transport (its Redis channel and QoS) is adapted in ``broker/`` only.

Read from the source with ``ast`` (imports inside functions count too). Tests are exempt: they check the
internals one module at a time (``broker/__init__.py`` says so).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import broker

ROOT = Path(__file__).resolve().parents[2]
OUTSIDE = ("protocol", "workers", "producer", "gateway", "tools", "bench", "store", "planner")
"""The packages that may use the broker only through its seam."""
TRANSPORT_OUTSIDE = {
    "producer/task_writer.py": "writes Celery's task message itself; reads the channel's list and event names",
    "bench/celery_floor.py": "puts stock kombu's channel back, to measure stock Celery's floor",
}
"""Modules outside ``broker/`` that import ``kombu.transport``, and why (not moved yet: see ``broker/__init__.py``)."""
SUBMODULES = frozenset(p.stem for p in (ROOT / "broker").glob("*.py") if p.stem != "__init__")


def _imports(package: str) -> Iterator[tuple[str, int, str, list[str]]]:
    """(file, line, imported module, names imported from it) for every import under ``package``."""
    for path in sorted((ROOT / package).rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield rel, node.lineno, alias.name, []
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                yield rel, node.lineno, node.module, [alias.name for alias in node.names]


def seam_breaches(package: str) -> list[str]:
    """``file:line: what`` for each import under ``package`` that goes past ``broker``'s seam."""
    out = []
    for rel, line, module, names in _imports(package):
        if module.startswith("broker."):
            out.append(f"{rel}:{line}: imports {module} (a submodule; use `from broker import …`)")
        elif module == "broker":
            for name in names:
                if name in SUBMODULES:
                    out.append(f"{rel}:{line}: imports the submodule broker.{name}")
                elif name not in broker.__all__:
                    out.append(f"{rel}:{line}: imports broker.{name}, which broker.__all__ does not name")
    return out


@pytest.mark.parametrize("package", OUTSIDE)
def test_the_fleet_calls_the_broker_only_through_its_seam(package: str) -> None:
    assert seam_breaches(package) == []


def test_the_broker_imports_nothing_above_it_and_protocol_nothing_of_it() -> None:
    above = [f"{rel}:{line}: {module}" for rel, line, module, _ in _imports("broker")
             if module.split(".")[0] in OUTSIDE and module.split(".")[0] != "protocol"]  # fmt: skip
    assert above == []
    below = [f"{rel}:{line}: {module}" for rel, line, module, _ in _imports("protocol")
             if module.split(".")[0] == "broker"]  # fmt: skip
    assert below == []


def test_every_name_of_the_seam_is_there() -> None:
    assert sorted(broker.__all__) == list(broker.__all__)
    missing = [name for name in broker.__all__ if not hasattr(broker, name)]
    assert missing == []
    assert not SUBMODULES & set(broker.__all__)  # the seam names callables and data, not modules


def test_kombus_transport_is_adapted_in_the_broker_only() -> None:
    found = {
        rel for package in OUTSIDE for rel, _, module, _ in _imports(package) if module.startswith("kombu.transport")
    }
    assert found == set(TRANSPORT_OUTSIDE)
