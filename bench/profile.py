"""Where a process's CPU goes: py-spy sampling, folded into components (parsing is pure).

``py-spy record --gil --format raw`` writes one line per distinct stack, ``frame;frame;…;leaf
count``, each frame ``function (package/file.py:line)``. Only the thread holding the GIL is
sampled, so the samples show where the process's Python-level CPU goes (time inside C code that
releases the GIL, such as ``session.run`` or a socket wait, is not sampled).

:func:`fold_components` answers "what share of the samples ran inside X" for a fixed list of
components (a sample counts for every component on its stack), and :func:`top_functions` lists
the heaviest leaf functions.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

__all__ = ["COMPONENTS", "fold_components", "parse_raw", "py_spy_path", "record", "top_functions"]

COMPONENTS: tuple[tuple[str, str], ...] = (
    ("ONNX Runtime session.run", r"(^|/)onnxruntime/capi/onnxruntime_inference_collection\.py"),
    ("result store (celery.backends)", r"(^|/)celery/backends/"),
    ("task events (celery.events)", r"(^|/)celery/events/"),
    ("logging", r"(^|/)logging/"),
    ("message transport (kombu)", r"(^|/)kombu/"),
    ("Redis client (redis-py)", r"(^|/)redis/"),
    ("JSON (de)serialization", r"(^|/)json/|kombu/serialization\.py"),
    ("pydantic validation", r"(^|/)pydantic"),
    ("Celery task tracing (celery.app.trace)", r"(^|/)celery/app/trace\.py"),
    ("Celery worker/consumer (celery.worker)", r"(^|/)celery/worker/"),
    ("Celery producer (celery.app.amqp/base)", r"(^|/)celery/app/(amqp|base)\.py"),
    ("Celery result waiting (celery.result)", r"(^|/)celery/result\.py|celery/backends/asynchronous\.py"),
    ("fleet worker code (workers/)", r"(^|/)workers/"),
    ("fleet client code (producer/)", r"(^|/)producer/"),
)
"""(label, regular expression on a frame's file path) of the components reported."""

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def py_spy_path() -> str | None:
    """The ``py-spy`` executable, or None when it is not installed (the profile is then skipped)."""
    return shutil.which("py-spy")


def parse_raw(text: str) -> list[tuple[list[tuple[str, str]], int]]:
    """Parse py-spy raw output into ``[(stack, count)]``, stack = ``[(function, file), …]`` root first.

    Lines that do not end with a count are skipped.
    """
    out: list[tuple[list[tuple[str, str]], int]] = []
    for line in text.splitlines():
        head, _, count = line.rstrip().rpartition(" ")
        if not head or not count.isdigit():
            continue
        stack = []
        for frame in head.split(";"):
            m = _FRAME.match(frame.strip())
            stack.append((m.group("func"), m.group("file")) if m else (frame.strip(), ""))
        out.append((stack, int(count)))
    return out


def fold_components(
    stacks: Iterable[tuple[list[tuple[str, str]], int]],
    components: tuple[tuple[str, str], ...] = COMPONENTS,
) -> tuple[int, dict[str, float]]:
    """(total samples, {component: share of samples in [0, 1] whose stack passes through it})."""
    patterns = [(label, re.compile(rx)) for label, rx in components]
    total = 0
    hits: Counter[str] = Counter()
    for stack, count in stacks:
        total += count
        files = [file for _, file in stack]
        for label, rx in patterns:
            if any(rx.search(f) for f in files):
                hits[label] += count
    return total, {label: (hits[label] / total if total else 0.0) for label, _ in components}


def top_functions(stacks: Iterable[tuple[list[tuple[str, str]], int]], n: int = 10) -> list[tuple[str, float]]:
    """The ``n`` leaf functions with the most samples: ``[("func (file)", share), …]``."""
    leaves: Counter[str] = Counter()
    total = 0
    for stack, count in stacks:
        total += count
        if stack:
            func, file = stack[-1]
            leaves[f"{func} ({_short(file)})"] += count
    return [(name, c / total) for name, c in leaves.most_common(n)] if total else []


def _short(file: str) -> str:
    marker = "site-packages/"
    return file.split(marker, 1)[1] if marker in file else Path(file).name


def record(pid: int, duration_s: float, out_file: Path, rate_hz: int = 200) -> subprocess.Popen[bytes]:
    """Start ``py-spy record --gil`` on ``pid`` for ``duration_s`` (non-blocking); returns the process.

    Raises:
        FileNotFoundError: py-spy is not installed.
    """
    exe = py_spy_path()
    if exe is None:
        raise FileNotFoundError("py-spy is not installed (pip install py-spy)")
    cmd = [
        exe,
        "record",
        "--pid",
        str(pid),
        "--duration",
        str(max(1, round(duration_s))),
        "--rate",
        str(rate_hz),
        "--format",
        "raw",
        "--output",
        str(out_file),
        "--nonblocking",
        "--gil",
    ]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
