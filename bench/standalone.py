"""What every ``fleet bench --only <phase>`` page shares: progress lines, its models (built once into the
work folder), and its stamp (command, commit, machine, duration) written with the page and its JSON."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["built", "preset_model", "say", "write_page"]


def say(msg: str) -> None:
    """One progress line on stderr."""
    print(f"[bench] {msg}", file=sys.stderr)


def built(model: Path, what: str, build: Callable[[], Any]) -> Path:
    """``model``, built by ``build()`` (and said, as ``what``) when the file is missing."""
    if not model.exists():
        say(f"building {what} → {model}")
        build()
    return model


def preset_model(preset: str, kind: str, work_dir: Path) -> Path:
    """The ``preset``'s model of ``kind`` (``tools.build_model.PRESETS``) under ``work_dir/models``."""
    from tools.build_model import PRESETS
    from tools.build_model import main as build_model_main

    name = PRESETS[preset][kind]["name"]
    return built(work_dir / "models" / name / f"{name}-1.0.0.onnx", f"the {preset} {kind} model",
                 lambda: build_model_main(["--preset", preset, "--kind", kind,
                                           "--out-dir", str(work_dir / "models")]))  # fmt: skip


def write_page(name: str, results: dict[str, Any], render: Callable[[dict[str, Any]], str], out_dir: Path, *,
               command: str, facts: dict[str, Any], started_unix_s: float) -> dict[str, Any]:  # fmt: skip
    """Stamp ``results`` (``meta``: the command, ``facts``' commit and machine, the duration since
    ``started_unix_s``), write ``<name>.json`` and ``<name>.md`` (``render(results)``) in ``out_dir``."""
    summary = f"{facts.get('cpu')}, {facts.get('logical_cores')} logical cores, {facts.get('memory_gib')} GiB"
    results["meta"] = {"command": command, "commit": facts.get("git_commit"), "dirty": facts.get("git_dirty"),
                       "machine": summary, "started_unix_s": started_unix_s,
                       "duration_s": time.time() - started_unix_s}  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(results, indent=1) + "\n")
    (out_dir / f"{name}.md").write_text(render(results))
    say(f"{name} done in {results['meta']['duration_s']:.0f} s: {out_dir / f'{name}.md'}")
    return results
