"""Which files of a folder belong to one model, and their digests (local disk only, no store).

A model folder may hold several models (``demo-lm-1.0.0.onnx`` beside its INT8 copy, each with its
own card and report), so a version takes, from the folder of its ONNX file:

* the ONNX file (role ``model``) and every external-data file its graph names (``external_data``);
* its card ``<stem>.json`` (``card``) and quantization report ``<stem>.report.json`` (``report``);
* the tokenizer file its card names (``tokenizer``), and Hugging Face's shared files when present:
  ``config.json``, ``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``,
  ``chat_template.jinja``, ``special_tokens_map.json``, ``added_tokens.json``, ``vocab.txt``,
  ``vocab.json``, ``merges.txt``, ``tokenizer.model``;
* a sentence-transformers ``modules.json`` and its modules' ``<path>/config.json`` (the pooling the
  model declares: :func:`protocol.pooling.pooling_files`).

Nothing else: other models' files, caches and the store's own ``manifest.json`` stay behind.
"""

from __future__ import annotations

import hashlib
import posixpath
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from protocol.errors import InvalidRequest, ModelLoadError
from protocol.modelcard import ModelCard, card_path_for
from protocol.pooling import pooling_files
from store.manifest import MANIFEST_NAME, FileRole

if TYPE_CHECKING:  # onnx costs ~0.8 s of CPU to import: only where a graph is read
    import onnx

__all__ = ["ModelFolder", "external_data_files", "hash_file", "model_file_in", "read_onnx", "select_files"]

CHUNK_BYTES = 1 << 20
"""Read size for hashing and copying (1 MiB)."""

_SHARED: dict[str, FileRole] = {
    "config.json": "config",
    "generation_config.json": "generation_config",
    "tokenizer.json": "tokenizer",
    "tokenizer_config.json": "tokenizer_config",
    "chat_template.jinja": "chat_template",
    "special_tokens_map.json": "tokenizer",
    "added_tokens.json": "tokenizer",
    "vocab.txt": "tokenizer",
    "vocab.json": "tokenizer",
    "merges.txt": "tokenizer",
    "tokenizer.model": "tokenizer",
}

ModelFolder = list[tuple[str, FileRole]]
"""(path relative to the model's folder, role) pairs."""


def model_file_in(path: Path) -> Path:
    """The ONNX file ``path`` names: itself, or the one ``*.onnx`` in the folder ``path``.

    Raises:
        InvalidRequest: (field ``path``) nothing there, not an ONNX file, or a folder with none or
            several ONNX files (they are listed: name one).
    """
    if path.is_file():
        if path.suffix != ".onnx":
            raise InvalidRequest(f"{path} is not an ONNX file (.onnx)", "path", ".onnx")
        return path
    if not path.is_dir():
        raise InvalidRequest(f"{path} does not exist", "path", None)
    found = sorted(p for p in path.glob("*.onnx") if p.is_file())
    if len(found) != 1:
        names = ", ".join(p.name for p in found) or "none"
        raise InvalidRequest(
            f"{path} holds {len(found)} ONNX files ({names}): name the model's file instead of its folder",
            "path",
            "one .onnx",
        )
    return found[0]


def _tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Every tensor of ``graph`` that can hold external data, subgraphs included."""
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from _tensors(attr.g)
            for sub in attr.graphs:
                yield from _tensors(sub)


def read_onnx(model_file: Path) -> onnx.ModelProto:
    """The ONNX model in ``model_file``, its weights in external data files left unread.

    Raises:
        ModelLoadError: ``<model_file> is not a readable ONNX model: …`` (a corrupt file, one that is no
            protobuf at all, one that cannot be read), field ``path``.
    """
    import onnx

    try:
        return onnx.load(str(model_file), load_external_data=False)
    except Exception as exc:  # onnx raises protobuf's DecodeError / OSError variants
        raise ModelLoadError(f"{model_file} is not a readable ONNX model: {exc}", "path", str(model_file)) from exc


def external_data_files(model_file: Path, proto: onnx.ModelProto | None = None) -> list[str]:
    """The external-data files ``model_file``'s graph names (relative to its folder), sorted;
    ``proto``: the model already read (:func:`read_onnx`), else it is read here.

    Raises:
        ModelLoadError: the file is not a readable ONNX model, or names a file outside its folder
            or one that does not exist.
    """
    import onnx

    proto = read_onnx(model_file) if proto is None else proto
    names: set[str] = set()
    for tensor in _tensors(proto.graph):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        location = next((e.value for e in tensor.external_data if e.key == "location"), None)
        if location:
            names.add(posixpath.normpath(location.replace("\\", "/")))  # "./w.data" is "w.data"
    folder = model_file.parent
    for name in names:  # judged by name, not by where a link points: a Hugging Face cache links every file
        if not _inside(name) or not (folder / name).is_file():
            raise ModelLoadError(
                f"{model_file} names external data {name!r}, which is not a file inside {folder}",
                "external_data",
                name,
            )
    return sorted(names)


def _inside(name: str) -> bool:
    """Whether ``name`` names a file inside a model's folder: relative, without ``..``, ``.`` or empty parts.

    By name only, so that a file that is a symbolic link (a Hugging Face cache's snapshot folder links
    each file to its blob) is taken, as its bytes are what is hashed and uploaded.
    """
    parts = name.split("/")
    return bool(name) and not name.startswith("/") and "\\" not in name and all(p not in ("", ".", "..") for p in parts)


def select_files(model_file: Path, card: ModelCard, proto: onnx.ModelProto | None = None) -> ModelFolder:
    """The files of ``model_file``'s folder that belong to it (see the module docstring), sorted;
    ``proto``: the model already read, else it is read here.

    Raises:
        ModelLoadError: an external-data file is missing or outside the folder; the card names a
            tokenizer file that is not there, or one outside the folder (field ``tokenizer``).
    """
    folder = model_file.parent
    chosen: dict[str, FileRole] = {model_file.name: "model"}
    chosen.update(dict.fromkeys(external_data_files(model_file, proto), "external_data"))
    own: list[tuple[Path, FileRole]] = [
        (card_path_for(model_file), "card"),
        (model_file.with_suffix(".report.json"), "report"),
    ]
    for path, role in own:
        if path.is_file():
            chosen[path.name] = role
    if card.tokenizer not in ("byte", "none"):
        tokenizer = posixpath.normpath(card.tokenizer)
        if not _inside(tokenizer):
            raise ModelLoadError(
                f"card of {model_file.name} names tokenizer {card.tokenizer!r}, outside {folder}: a version "
                "holds the files of its model's folder only; copy the tokenizer there and name it by its file name",
                "tokenizer",
                card.tokenizer,
            )
        if not (folder / tokenizer).is_file():
            raise ModelLoadError(
                f"card of {model_file.name} names tokenizer {card.tokenizer!r}, which is not in {folder}",
                "tokenizer",
                card.tokenizer,
            )
        chosen.setdefault(tokenizer, "tokenizer")
    for name, role in _SHARED.items():
        if (folder / name).is_file():
            chosen.setdefault(name, role)
    for name in pooling_files(folder):  # an encoder's declared pooling travels with it
        chosen.setdefault(name, "config")
    chosen.pop(MANIFEST_NAME, None)
    return sorted(chosen.items())


def hash_file(path: Path, progress: Callable[[int], None] | None = None) -> tuple[str, int]:
    """(sha256 hex digest, size in bytes) of ``path``, read in 1 MiB chunks; ``progress(n)`` per chunk."""
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as fh:
        while chunk := fh.read(CHUNK_BYTES):
            digest.update(chunk)
            size += len(chunk)
            if progress is not None:
                progress(len(chunk))
    return digest.hexdigest(), size
