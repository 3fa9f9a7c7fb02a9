"""Where built models go and how they are written: ``<out_dir>/<name>/<name>-<version>.onnx`` + card.

Publishing a model is safe beside readers (workers, the gateway) and beside other builders (two
``fleet demo`` at once, ``fleet build-model`` beside a demo, two CI jobs in one checkout):

* every file is written under a unique temporary name in its own folder (``tempfile``), flushed to
  disk, then renamed over the final name (``os.replace``, atomic on one file system): a reader sees the
  old file or the new one, never part of one;
* the files that go with a model (the folder's sidecars such as ``generation_config.json``, then the
  card) are published BEFORE the ``.onnx`` file, so whoever finds the model finds its card;
* builders of the same model take turns: each holds an exclusive lock (``fcntl.flock`` on the model's
  folder itself: no lock file) while it publishes, so two builders never
  interleave their card and model. The builders are seeded, so the second of two identical builds
  writes identical bytes: a file whose bytes are already there is left untouched (no rename at all).

A *different* model under an existing name and version (another ``--seed``) replaces the old one
file by file; a reader that starts in between sees the new card beside the old graph. Give a changed
model a new version instead (``--version``).
"""

from __future__ import annotations

import fcntl
import os
import re
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from protocol.modelcard import ModelCard, card_path_for

if TYPE_CHECKING:  # onnx takes ~1 s to import; the writers below only call SerializeToString()
    import onnx

__all__ = ["card_metadata", "model_path", "publish_model", "write_atomic", "write_model"]

_SAFE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


def model_path(out_dir: Path, name: str, version: str) -> Path:
    """``<out_dir>/<name>/<name>-<version>.onnx``.

    Raises:
        ValueError: ``name`` or ``version`` is empty or holds characters unsafe in a file name.
    """
    for label, value in (("name", name), ("version", version)):
        if not _SAFE.match(value):
            raise ValueError(f"model {label} {value!r} must match {_SAFE.pattern}")
    return Path(out_dir) / name / f"{name}-{version}.onnx"


def card_metadata(card: ModelCard) -> dict[str, object]:
    """The card fields copied into the ONNX ``metadata_props`` (read back by the worker's engine).

    ``num_kv_heads`` is there only when the card sets it (grouped-query attention)."""
    meta: dict[str, object] = {
        "name": card.name,
        "version": card.version,
        "kind": card.kind,
        "vocab_size": card.vocab_size,
        "max_positions": card.max_positions,
        "num_layers": card.num_layers,
        "num_heads": card.num_heads,
        "head_dim": card.head_dim,
        "hidden_size": card.hidden_size,
    }
    if card.num_kv_heads is not None:
        meta["num_kv_heads"] = card.num_kv_heads
    return meta


def write_atomic(path: Path, data: bytes) -> bool:
    """Make ``path`` hold ``data``: a unique temporary file in the same folder, fsynced, renamed over it.

    Returns False (and writes nothing) when ``path`` already holds exactly ``data``, True otherwise.
    The temporary file is removed if the write fails. Creates the folder if needed.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        if path.stat().st_size == len(data) and path.read_bytes() == data:
            return False
    except FileNotFoundError:
        pass
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; readers may run as another user (a container's worker)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


@contextmanager
def _publish_lock(model_file: Path) -> Iterator[None]:
    """Hold the exclusive lock of ``model_file``'s folder (``flock`` on the folder itself, so no lock file is
    left among the model's files, where ``fleet models push`` and copies of the folder would find it); blocks
    until it is free. Released when the descriptor closes, also if the builder dies."""
    fd = os.open(model_file.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def publish_model(path: Path, model_bytes: bytes, card: ModelCard,
                  sidecars: Mapping[str, bytes] | None = None) -> Path:
    """Publish a serialized model at ``path``: ``sidecars`` (file name -> bytes, in ``path``'s folder),
    then the card (JSON), then the ``.onnx`` file, each with :func:`write_atomic`, under the model's
    lock (see the module docstring). Returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    card_bytes = (card.model_dump_json(indent=2) + "\n").encode()
    with _publish_lock(path):
        for name, data in (sidecars or {}).items():
            write_atomic(path.parent / name, data)
        write_atomic(card_path_for(path), card_bytes)
        write_atomic(path, model_bytes)
    return path


def write_model(model: onnx.ModelProto, card: ModelCard, out_dir: Path,
                sidecars: Mapping[str, bytes] | None = None) -> Path:
    """Write ``model``, its card (JSON) and ``sidecars`` to :func:`model_path`; returns the ``.onnx`` path.

    See :func:`publish_model` (order, atomicity, concurrent builders).

    Raises:
        ValueError: the card's name or version is unsafe in a file name.
    """
    path = model_path(out_dir, card.name, card.version)
    return publish_model(path, model.SerializeToString(), card, sidecars)
