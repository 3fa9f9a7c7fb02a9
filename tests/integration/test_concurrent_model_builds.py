"""Two builders of one model at once (two ``fleet demo``, ``fleet build-model`` beside a demo, two CI
jobs in one checkout), and what a reader (a worker starting, the gateway) can see meanwhile.

Each builder is a real ``fleet build-model`` process paused before every rename it makes
(tests/integration/concurrent_build_harness.py); the test lets the renames happen one at a time in a
fixed order and, at every pause, reads the folder as the fleet would: every ``.onnx`` there loads
(onnx and an ONNX Runtime session), its card is there and matches the graph's metadata, and the files
that go with it (generation assets, the WordPiece tokenizer) are there and whole.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
from pathlib import Path

import onnx
import onnxruntime as ort
import pytest
from tokenizers import Tokenizer

from protocol.generation_config import GENERATION_CONFIG, TOKENIZER_CONFIG
from protocol.modelcard import card_path_for, load_card
from tools.artifacts import card_metadata

ROOT = Path(__file__).resolve().parents[2]
EVENT_DEADLINE_S = 60.0  # a builder that says nothing for this long is stuck (a guard, not a wait)


class PausedBuilder:
    """One builder process; :meth:`next_event` is its next ``@@`` line, or None once it has exited."""

    def __init__(self, out_dir: Path, kind: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.concurrent_build_harness", "--kind", kind,
             "--out-dir", str(out_dir)],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.events: queue.Queue[str | None] = queue.Queue()
        self.stderr = ""
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                self.events.put(line[3:].strip())
        self.events.put(None)

    def next_event(self) -> str | None:
        return self.events.get(timeout=EVENT_DEADLINE_S)

    def next_pause(self) -> str | None:
        """The next rename it waits on (lock announcements skipped), or None once it has exited."""
        while (event := self.next_event()) is not None and not event.startswith("replace "):
            pass
        return event

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def finish(self, folder: Path) -> None:
        """Let every remaining rename happen, reading the folder before each; it must exit 0."""
        while self.next_pause() is not None:
            assert_readable(folder)
            self.go()
        _, err = self.proc.communicate(timeout=EVENT_DEADLINE_S)
        assert self.proc.returncode == 0, f"builder exited {self.proc.returncode}: {err.strip()[-2000:]}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def assert_readable(folder: Path) -> None:
    """What a reader sees in ``folder`` is whole and consistent (see the module docstring)."""
    for model_file in sorted(folder.glob("*.onnx")):
        card_file = card_path_for(model_file)
        assert card_file.exists(), f"{model_file.name} is visible without its card {card_file.name}"
        card = load_card(model_file)
        meta = {p.key: p.value for p in onnx.load(str(model_file)).metadata_props}
        assert meta == {k: str(v) for k, v in card_metadata(card).items()}, f"{card_file.name} vs {model_file.name}"
        ort.InferenceSession(str(model_file), providers=["CPUExecutionProvider"])
        if card.kind == "causal_lm":
            for name in (GENERATION_CONFIG, TOKENIZER_CONFIG):
                assert (folder / name).exists(), f"{model_file.name} is visible without {name}"
        if card.tokenizer != "byte":
            Tokenizer.from_file(str(folder / card.tokenizer))
    for doc in folder.glob("*.json"):
        json.loads(doc.read_text())


def _published(folder: Path) -> dict[str, bytes]:
    """Every file in ``folder`` but builders' temporary files: name -> bytes."""
    return {p.name: p.read_bytes() for p in folder.iterdir() if not p.name.endswith(".tmp")}


@pytest.mark.parametrize(("kind", "name"), [("lm", "demo-lm"), ("encoder", "demo-encoder")])
def test_two_builders_of_one_model_publish_whole_consistent_files(tmp_path: Path, kind: str, name: str) -> None:
    """A is paused at its first rename when B starts; B gets as far as it can (its first rename, or
    the lock A holds); then A finishes and B after it. Both exit 0, and at every pause the folder reads
    as whole. Identical builds (seeded) agree on every byte."""
    folder = tmp_path / name
    first = PausedBuilder(tmp_path, kind)
    second: PausedBuilder | None = None
    try:
        assert first.next_pause() is not None, "builder A exited before publishing anything"
        assert_readable(folder)
        second = PausedBuilder(tmp_path, kind)
        second_event = second.next_event()  # paused at its first rename, or at A's lock
        assert second_event is not None, "builder B exited at once"
        first.go()
        first.finish(folder)
        blessed = _published(folder)
        if second_event.startswith("replace "):
            assert_readable(folder)
            second.go()
        second.finish(folder)
    finally:
        for builder in (first, second):
            if builder is not None:
                builder.kill()
    assert_readable(folder)
    assert _published(folder) == blessed  # B changed nothing A published
    assert not [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]


def test_a_model_file_appears_only_after_its_card_and_folder_files(tmp_path: Path) -> None:
    """One builder of every kind, paused before each rename: the order is sidecars, card, model."""
    builder = PausedBuilder(tmp_path, "all")
    order: list[str] = []
    try:
        while (event := builder.next_pause()) is not None:
            order.append(Path(event.split(" ", 1)[1]).name)
            for folder in tmp_path.iterdir():
                assert_readable(folder)
            builder.go()
        assert builder.proc.wait(timeout=EVENT_DEADLINE_S) == 0
    finally:
        builder.kill()
    for stem in ("demo-lm-1.0.0", "demo-llama-1.0.0", "demo-encoder-1.0.0", "identity-1.0.0"):
        assert order.index(f"{stem}.json") < order.index(f"{stem}.onnx"), order
