"""Publishing a model folder as a version: checksum, claim, upload, then the manifest last.

1. Refuse a file that holds no model graph, or whose graph contradicts its card
   (:mod:`store.graph_fit`), and refuse when ``<model>/<version>/manifest.json`` exists: published
   versions are immutable.
2. Hash every file that belongs to the model (:mod:`store.files`) and build the manifest.
3. Claim the version: an exclusive write of ``<model>/<version>/.publishing.json`` (who, when). Two
   pushes of one version race here, and exactly one wins (on a server with conditional puts; see
   :mod:`store.s3`). The loser is refused with :class:`VersionExists` naming the holder. A push that
   died leaves its claim and no manifest: ``takeover=True`` replaces such an unfinished version.
   Then the manifest is looked for again: a push that finished (and dropped its claim) while this one
   was hashing has published the version, and this one stops before it uploads a byte.
4. Upload the files (each one's stored size is checked).
5. Write the manifest, exclusively: the moment it exists the version is published and complete.
6. Drop the claim.

A version without a manifest is never listed as published and never fetched.
"""

from __future__ import annotations

import getpass
import json
import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from protocol.errors import ModelLoadError
from protocol.modelcard import ModelCard, load_card
from store.backend import Backend, ProgressBar, progress_bar
from store.errors import ObjectExists, StoreError, VersionExists
from store.files import hash_file, model_file_in, read_onnx, select_files
from store.graph_fit import graph_mismatches
from store.manifest import MANIFEST_NAME, FileRole, Manifest, ManifestFile, check_name, encode_manifest

if TYPE_CHECKING:  # onnx costs ~0.8 s of CPU to import: only where a graph is read
    import onnx

__all__ = ["CLAIM_NAME", "default_publisher", "publish"]

CLAIM_NAME = ".publishing.json"
"""The claim a push holds while it uploads; a version folder with only this is unfinished."""


def default_publisher() -> str:
    """``user@host`` of this process, recorded as the manifest's ``created_by``."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (containers with a bare uid)
        user = f"uid{os.getuid()}"
    return f"{user}@{socket.gethostname()}"


def publish(
    backend: Backend,
    path: Path,
    model: str,
    version: str,
    *,
    created_by: str | None = None,
    takeover: bool = False,
    progress: ProgressBar | None = None,
) -> Manifest:
    """Publish the model at ``path`` (its ONNX file, or a folder holding exactly one) as ``model`` ``version``.

    Returns:
        The manifest written.

    Raises:
        InvalidRequest: a bad name or path; the card's precision is unknown.
        ModelLoadError: the model, its card or a file it names cannot be read; the file holds no model
            graph (field ``path``), or its graph contradicts its card (field: the card's, e.g. ``vocab_size``);
            a file it names cannot be published (a tokenizer outside its folder).
        VersionExists: the version is published (before this push, or by one that finished while this one
            hashed), or another push holds its claim (without ``takeover``).
        StoreError: the store cannot be reached or refused; an upload's stored size is wrong.
    """
    check_name(model, "model")
    check_name(version, "version")
    model_file = model_file_in(Path(path))
    card = load_card(model_file)
    proto = read_onnx(model_file)
    _check_graph(model_file, proto, card)
    prefix = f"{model}/{version}/"
    if backend.exists(prefix + MANIFEST_NAME):
        raise _published(backend, model, version)
    folder = model_file.parent
    selected = select_files(model_file, card, proto)
    del proto  # the graph (weights included when they are inside the file) is not needed while uploading
    total = sum((folder / rel).stat().st_size for rel, _ in selected)
    entries: list[ManifestFile] = []
    with progress_bar(progress, f"sha256 {model} {version}", total) as advance:
        for rel, role in selected:
            sha256, size = hash_file(folder / rel, advance)
            entries.append(_entry(model_file, rel, role, sha256, size))
    who = created_by or default_publisher()
    try:
        manifest = Manifest.build(
            model=model, version=version, card=card, files=entries, created_by=who, now_unix_s=time.time()
        )
    except ValidationError as exc:  # e.g. a tokenizer or external-data file named like a dot-file
        raise ModelLoadError(f"{model_file}: its files cannot be published: {_problems(exc)}", "files",
                             str(folder)) from None
    _claim(backend, prefix, model, version, manifest, takeover=takeover)
    if backend.exists(prefix + MANIFEST_NAME):
        # a push that finished between the check above and this claim (it dropped its own claim): uploading
        # now would overwrite the files of a published version
        backend.delete(prefix + CLAIM_NAME)
        raise _published(backend, model, version, meanwhile=True)
    with progress_bar(progress, f"upload {model} {version}", manifest.total_bytes) as advance:
        for entry in manifest.files:
            stored = backend.upload(prefix + entry.path, folder / entry.path, advance)
            if stored != entry.size_bytes:
                raise StoreError(
                    f"{backend.url_of(prefix + entry.path)} holds {stored} bytes after upload, the file has "
                    f"{entry.size_bytes}: was it changed during the push?",
                    entry.path,
                    entry.size_bytes,
                )
    try:
        backend.write(prefix + MANIFEST_NAME, encode_manifest(manifest), exclusive=True)
    except ObjectExists:
        raise _published(backend, model, version, meanwhile=True) from None
    backend.delete(prefix + CLAIM_NAME)
    return manifest


def _check_graph(model_file: Path, proto: onnx.ModelProto, card: ModelCard) -> None:
    """Refuse a file that holds no model graph, or whose graph contradicts its card (:mod:`store.graph_fit`)."""
    found = graph_mismatches(proto, card)
    if not found:
        return
    if found[0].field == "graph":
        raise ModelLoadError(
            f"{model_file} is not an ONNX model: its graph has {found[0].graph_value} (an empty or truncated "
            "file?); nothing was published",
            "path",
            str(model_file),
        )
    raise ModelLoadError(
        f"the card of {model_file} contradicts its graph: " + "; ".join(m.describe() for m in found)
        + "; fix the card (a published version never changes); nothing was published",
        found[0].field,
        found[0].graph_value,
    )


def _entry(model_file: Path, rel: str, role: FileRole, sha256: str, size: int) -> ManifestFile:
    try:
        return ManifestFile(path=rel, role=role, sha256=sha256, size_bytes=size)
    except ValidationError as exc:
        raise ModelLoadError(f"{model_file}: the {role} file {rel!r} cannot be published: {_problems(exc)}",
                             role, rel) from None


def _problems(exc: ValidationError) -> str:
    return "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())


def _claim(backend: Backend, prefix: str, model: str, version: str, manifest: Manifest, *, takeover: bool) -> None:
    claim = json.dumps({
        "by": manifest.created_by,
        "at": manifest.created_at,
        "pid": os.getpid(),
        "files": len(manifest.files),
        "total_bytes": manifest.total_bytes,
    }).encode()
    try:
        backend.write(prefix + CLAIM_NAME, claim, exclusive=True)
        return
    except ObjectExists:
        if backend.exists(prefix + MANIFEST_NAME):
            raise _published(backend, model, version, meanwhile=True) from None
        if not takeover:
            holder = (backend.read(prefix + CLAIM_NAME) or b"{}").decode(errors="replace")
            raise VersionExists(
                f"{model} {version} is being published by another push, or one that died before writing its "
                f"manifest (claim {holder}); retry with takeover (fleet models push --takeover) to replace an "
                "unfinished version",
                "version",
                version,
            ) from None
    backend.write(prefix + CLAIM_NAME, claim)


def _published(backend: Backend, model: str, version: str, *, meanwhile: bool = False) -> VersionExists:
    when = " by a concurrent push" if meanwhile else ""
    return VersionExists(
        f"{model} {version} is already published{when} in {backend.location}: published versions are never "
        "overwritten; publish under a new version",
        "version",
        version,
    )
