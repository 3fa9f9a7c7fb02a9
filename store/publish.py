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
4. Clear the version: delete every object under ``<model>/<version>/`` but the claim (what a push that
   died, or the one taken over, left there: its files, also those whose names this push's manifest does not
   have, and a local store's temporary files), listed with :meth:`~store.backend.Backend.keys`.
5. Upload the files, each exclusively (only if nothing is under its key when it lands; each one's stored
   size is checked).
6. Clear again what its manifest does not name (files of the replaced push that landed after step 4), then
   write the manifest, exclusively: the moment it exists the version is published and complete, and its
   folder holds its files and nothing else.
7. Drop the claim.

Fencing: each claim holds a random ``token``. Before each upload, each delete of a clearing and before the
manifest, a push reads the claim back; when it no longer holds this push's token (a ``takeover`` replaced
it, or the push that took over has finished and dropped it), the push stops with :class:`VersionExists` and
writes nothing more, so a version's files and manifest come from one push even when ``takeover`` replaced a
push that was still running. An upload of the replaced push already past its fence read (in flight) when
the takeover came lands either before the takeover's upload of that file, which is then refused (the takeover stops with
:class:`VersionExists` naming the file the push it replaced is still writing, writes no manifest, and the
version stays unfinished: retry the takeover once that push has stopped), or after it, and is refused
itself (that push stops). So no manifest is written over a file of another push. Two gaps remain: a server
without conditional puts (the 501 fallback of :mod:`store.s3`; exclusive is check-then-put there), and a
push taken over in the one round trip between its last fence read and its manifest write (or one delete of
a clearing), whose files the takeover then clears. The fetch's sha256 check (:mod:`store.fetch`) refuses
such a version rather than serve it. A file of the replaced push under a name this manifest lacks that lands
in the round trip between the second clearing and the manifest stays, unreferenced (never listed or fetched).

An exclusive upload refused by an object that holds this push's own bytes (its first attempt landed, the
response was lost and botocore retried it: :mod:`store.s3`) counts as done.

A version without a manifest is never listed as published and never fetched.
"""

from __future__ import annotations

import getpass
import json
import os
import secrets
import socket
import time
from collections.abc import Callable, Collection
from functools import partial
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
            hashed), or another push holds its claim (without ``takeover``), or another push took this one's
            claim over while it uploaded (the fence in the module docstring), or a file this push uploads was
            written meanwhile by the push it took over (field: the file; the version stays unfinished).
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
    token = _claim(backend, prefix, model, version, manifest, takeover=takeover)
    if backend.exists(prefix + MANIFEST_NAME):
        # a push that finished between the check above and this claim (it dropped its own claim): uploading
        # now would overwrite the files of a published version
        backend.delete(prefix + CLAIM_NAME)
        raise _published(backend, model, version, meanwhile=True)
    clearing = partial(_fence, backend, prefix, model, version, token, "clearing the version")
    _clear(backend, prefix, keep=(), fence=clearing)  # step 4: an exclusive upload is refused by any file there
    with progress_bar(progress, f"upload {model} {version}", manifest.total_bytes) as advance:
        for entry in manifest.files:
            _fence(backend, prefix, model, version, token, f"uploading {entry.path}")
            try:
                stored = backend.upload(prefix + entry.path, folder / entry.path, advance, exclusive=True)
            except ObjectExists:
                raise _upload_refused(backend, prefix, model, version, token, entry.path) from None
            if stored != entry.size_bytes:
                raise StoreError(
                    f"{backend.url_of(prefix + entry.path)} holds {stored} bytes after upload, the file has "
                    f"{entry.size_bytes}: was it changed during the push?",
                    entry.path,
                    entry.size_bytes,
                )
    fence = partial(_fence, backend, prefix, model, version, token, "writing its manifest")
    _clear(backend, prefix, keep={entry.path for entry in manifest.files}, fence=fence)  # landed since step 4
    fence()
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


def _claim(backend: Backend, prefix: str, model: str, version: str, manifest: Manifest, *, takeover: bool) -> str:
    """Write this push's claim; returns its fencing token (see the module docstring)."""
    token = secrets.token_hex(16)
    claim = json.dumps({
        "token": token,
        "by": manifest.created_by,
        "at": manifest.created_at,
        "pid": os.getpid(),
        "files": len(manifest.files),
        "total_bytes": manifest.total_bytes,
    }).encode()
    try:
        backend.write(prefix + CLAIM_NAME, claim, exclusive=True)
        return token
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
    return token


def _clear(backend: Backend, prefix: str, *, keep: Collection[str], fence: Callable[[], None]) -> None:
    """Delete every object under ``prefix`` but the claim (and the manifest, should one be there) and the
    relative names in ``keep``: what a push that died or was taken over left (its files, including names this
    push's manifest does not have, and a local store's temporary files). ``fence()`` runs before each delete
    (:func:`_fence`), so a push taken over meanwhile stops instead of deleting the files of the one that took
    it over; nothing left over: no delete, no extra read."""
    for key in backend.keys(prefix):
        rel = key[len(prefix):]
        if rel not in (CLAIM_NAME, MANIFEST_NAME) and rel not in keep:
            fence()
            backend.delete(key)


def _fence(backend: Backend, prefix: str, model: str, version: str, token: str, step: str) -> None:
    """Raise :class:`VersionExists` unless the version's claim still holds ``token`` (this push's)."""
    raw = backend.read(prefix + CLAIM_NAME)
    if not _holds(raw, token):
        raise _taken_over(model, version, raw, f"stopped before {step}")


def _holds(raw_claim: bytes | None, token: str) -> bool:
    """True when the claim's bytes ``raw_claim`` hold ``token``."""
    try:
        held = json.loads(raw_claim) if raw_claim is not None else None
    except ValueError:
        held = None
    return isinstance(held, dict) and held.get("token") == token


def _taken_over(model: str, version: str, raw_claim: bytes | None, what: str) -> VersionExists:
    finished = "none: the push that took over has finished"
    holder = raw_claim.decode(errors="replace") if raw_claim is not None else finished
    return VersionExists(
        f"{model} {version}: this push was taken over by another (fleet models push --takeover; claim now "
        f"{holder}) and {what}; it publishes nothing, the version's files and manifest are the other push's",
        "version",
        version,
    )


def _upload_refused(backend: Backend, prefix: str, model: str, version: str, token: str, rel: str) -> VersionExists:
    """The error for an exclusive upload of ``rel`` that found a file there (another push's, landed after step 4)."""
    raw = backend.read(prefix + CLAIM_NAME)
    if not _holds(raw, token):  # this push is the one replaced: its upload landed after the takeover's
        return _taken_over(model, version, raw, f"its upload of {rel} was refused (the other push's is there)")
    return VersionExists(
        f"{model} {version}: {backend.url_of(prefix + rel)} was written by another push after this one cleared the "
        "version: the push it took over (or one whose claim was removed) is still writing; this push stopped and "
        "published nothing, the version stays unfinished: retry with takeover (fleet models push --takeover) once "
        "that push has stopped",
        rel,
        version,
    )


def _published(backend: Backend, model: str, version: str, *, meanwhile: bool = False) -> VersionExists:
    when = " by a concurrent push" if meanwhile else ""
    return VersionExists(
        f"{model} {version} is already published{when} in {backend.location}: published versions are never "
        "overwritten; publish under a new version",
        "version",
        version,
    )
