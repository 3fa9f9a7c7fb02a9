"""Verified download of a version into the local cache: ``<cache_dir>/<model>/<version>/``.

The files are downloaded into a private ``.<version>.partial-<pid>-…`` folder beside the final one,
each checked against the manifest (sha256 and size) as soon as it lands; only when every file
matches are the manifest and a verification marker written and the folder renamed into place (one
atomic rename). A mismatch removes the partial folder and raises :class:`ChecksumMismatch` naming
the file and both checksums, so no half-verified version is ever in the cache.

Reuse: a version already in the cache is used without asking the store (versions are immutable, so
a worker also starts while the store is down). The check is cheap: the marker must hold the sha256
of the cached ``manifest.json`` and every file must exist with its manifest size. Hashing every
byte again at each start would cost seconds per GB; the folder only ever appears through the rename
above, after a full verification, so what the marker guards against is truncation and deletion,
not bit rot. ``reverify=True`` (``store.reverify_cached``) re-hashes everything instead. A cached
version that fails its check is removed and fetched again.

Pinned bytes: a version name can come to hold other bytes (deleted and pushed again, a racing push on a store
without conditional puts, files replaced in the bucket). A pin or canary records its manifest's sha256, and
the worker passes it as ``manifest_sha256``: a cached copy made from another manifest is not used, and a
store manifest with another sha256 is refused ("changed since it was pinned"), so every worker serves the
pinned bytes or none. Without it (a record made before digests were kept, the configured version) any
manifest is taken, as before.

Stopping early: a caller that may stop wanting the version (the reconciler, when the desired state moves on
during a load) passes a ``stop`` event; the fetch checks it after the manifest and after each file, and
raises :class:`Stopped` when it is set, removing its partial folder as for a failed fetch. A read already
in flight is not interrupted: it ends when the store answers or its socket times out (:mod:`store.s3`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

from protocol.errors import ModelLoadError
from store.backend import Backend, ProgressBar, progress_bar
from store.errors import CacheUnwritable, ChecksumMismatch, ObjectMissing, VersionNotFound
from store.files import hash_file
from store.manifest import MANIFEST_NAME, Manifest, ManifestFile, check_name, decode_manifest, manifest_digest
from store.publish import CLAIM_NAME

__all__ = ["MARKER_NAME", "Stopped", "cached_model_file", "fetch", "process_token", "stop_if"]

log = logging.getLogger("fleet.store")

MARKER_NAME = ".fleet-verified.json"
"""Written into a version's cache folder after every file matched its manifest."""


class Stopped(Exception):
    """The caller's ``stop`` event was set: the fetch (or the load around it) ended between two steps;
    ``step`` names the last one done. Not a FleetError: it never reaches a client (the reconciler logs it
    and discards the load)."""

    def __init__(self, step: str) -> None:
        super().__init__(f"stopped after {step}")
        self.step = step


def stop_if(stop: threading.Event | None, step: str) -> None:
    """Raise :class:`Stopped` when ``stop`` is set; ``step`` names the step just done (for the log)."""
    if stop is not None and stop.is_set():
        raise Stopped(step)


def fetch(
    backend: Backend,
    model: str,
    version: str,
    cache_dir: Path,
    *,
    reverify: bool = False,
    manifest_sha256: str | None = None,
    progress: ProgressBar | None = None,
    stop: threading.Event | None = None,
) -> Path:
    """The verified local copy of ``model`` ``version``: the path of its ONNX file in the cache.

    Args:
        cache_dir: the cache's root; the version lands in ``<cache_dir>/<model>/<version>/``.
        reverify: re-hash a cached version's files instead of the cheap check.
        manifest_sha256: when given (recorded with a pin or canary), the manifest's own sha256 must equal it,
            in the store and in the cache: a cached copy made from another manifest is removed and the version
            fetched anew, and a store manifest with another sha256 is refused (nothing is installed).
        stop: checked after the manifest and after each file (see the module docstring).

    Raises:
        InvalidRequest: a bad model or version name.
        VersionNotFound: no manifest is published for it (a claim alone: a push is unfinished).
        ChecksumMismatch: a file is not what the manifest says, or (field ``manifest_sha256``) the manifest is
            not the one ``manifest_sha256`` names ("changed since it was pinned").
        ModelLoadError: the manifest is invalid, names another version, or lists a file the store lacks.
        CacheUnwritable: the cache cannot hold it (disk full, read-only, not a folder); nothing is installed.
        StoreError: the store cannot be reached or refused.
        Stopped: ``stop`` was set; nothing of the version was installed.
    """
    check_name(model, "model")
    check_name(version, "version")
    final = Path(cache_dir) / model / version
    cached = cached_model_file(final, model, version, reverify=reverify, manifest_sha256=manifest_sha256)
    if cached is not None:
        return cached
    prefix = f"{model}/{version}/"
    raw = backend.read(prefix + MANIFEST_NAME)
    if raw is None:
        unfinished = " (a push has claimed it but not finished)" if backend.exists(prefix + CLAIM_NAME) else ""
        raise VersionNotFound(
            f"{model} {version} is not published in {backend.location}{unfinished}; {VersionNotFound.FIX}",
            "version",
            version,
        )
    where = backend.url_of(prefix + MANIFEST_NAME)
    _check_manifest_digest(raw, manifest_sha256, model, version, where)
    manifest = _decoded(raw, model, version, where)
    stop_if(stop, "the manifest")
    try:
        _download(backend, manifest, raw, final, progress, stop)
    except OSError as exc:  # the cache's disk: full, read-only, a file where a folder must be
        raise _unwritable(exc, Path(cache_dir), manifest) from exc
    log.info("fetched %s %s (%d files, %d bytes) from %s into %s", model, version, len(manifest.files),
             manifest.total_bytes, backend.location, final)
    found = cached_model_file(final, model, version, reverify=False, manifest_sha256=manifest_sha256)
    if found is None:  # another process replaced it between the rename and now
        raise ModelLoadError(f"{final} changed while it was being installed", "cache_dir", str(final))
    return found


def _download(
    backend: Backend, manifest: Manifest, raw: bytes, final: Path, progress: ProgressBar | None,
    stop: threading.Event | None,
) -> None:
    """Download, verify and install ``manifest``'s files as ``final`` (see the module docstring); ``stop``
    is checked after each file (:class:`Stopped`: the partial folder is removed)."""
    model, version = manifest.model, manifest.version
    prefix = f"{model}/{version}/"
    final.parent.mkdir(parents=True, exist_ok=True)
    _sweep_partials(final.parent, version)
    partial = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{version}.partial-{process_token()}-"))
    try:
        with progress_bar(progress, f"fetch {model} {version}", manifest.total_bytes) as advance:
            for entry in manifest.files:
                dest = partial / entry.path
                dest.parent.mkdir(parents=True, exist_ok=True)
                try:
                    backend.download(prefix + entry.path, dest, advance)
                except ObjectMissing as exc:
                    raise ModelLoadError(
                        f"{model} {version}: {entry.path} is listed in the manifest but missing from the store "
                        f"({backend.url_of(prefix + entry.path)})",
                        entry.path,
                        entry.sha256,
                    ) from exc
                _verify(dest, entry, model, version, backend.url_of(prefix + entry.path))
                stop_if(stop, entry.path)
        (partial / MANIFEST_NAME).write_bytes(raw)
        marker = {"manifest_sha256": manifest_digest(raw), "verified_unix_s": time.time(), "pid": os.getpid()}
        (partial / MARKER_NAME).write_text(json.dumps(marker) + "\n")
        _install(partial, final)
    finally:
        shutil.rmtree(partial, ignore_errors=True)  # gone already when the rename happened


def _unwritable(exc: OSError, cache_dir: Path, manifest: Manifest) -> CacheUnwritable:
    """The error naming the cache, why the OS refused, and the bytes the version needs against those free."""
    free = ""
    for folder in (cache_dir, *cache_dir.parents):
        if folder.is_dir():
            free = f", {shutil.disk_usage(folder).free} bytes are free there"
            break
    return CacheUnwritable(
        f"cannot write {manifest.model} {manifest.version} into the cache {cache_dir} (store.cache_dir): "
        f"{exc.strerror or exc}{f': {exc.filename}' if exc.filename else ''}; the version needs "
        f"{manifest.total_bytes} bytes{free}; nothing of it was installed",
        "store.cache_dir",
        str(cache_dir),
    )


def cached_model_file(
    folder: Path, model: str, version: str, *, reverify: bool = False, manifest_sha256: str | None = None
) -> Path | None:
    """The ONNX file of the verified version in ``folder``; None when it is not there (or failed its
    check, in which case the folder is removed so that it is fetched anew)."""
    if not folder.is_dir():
        return None
    problem = _cache_problem(folder, model, version, reverify, manifest_sha256)
    if problem is None:
        manifest = decode_manifest((folder / MANIFEST_NAME).read_bytes(), str(folder / MANIFEST_NAME))
        return folder / manifest.model_file
    log.warning("cached %s %s in %s is not usable (%s): removing it to fetch again", model, version, folder, problem)
    _remove(folder)
    return None


def _cache_problem(
    folder: Path, model: str, version: str, reverify: bool, manifest_sha256: str | None
) -> str | None:
    try:
        raw = (folder / MANIFEST_NAME).read_bytes()
        marker = json.loads((folder / MARKER_NAME).read_text())
    except (OSError, ValueError) as exc:
        return f"no readable manifest and marker: {exc}"
    digest = manifest_digest(raw)
    if not isinstance(marker, dict) or marker.get("manifest_sha256") != digest:
        return "the marker does not match the manifest"
    if manifest_sha256 is not None and digest != manifest_sha256:
        return f"manifest sha256 {digest}, expected {manifest_sha256}"
    try:
        manifest = _decoded(raw, model, version, str(folder / MANIFEST_NAME))
    except ModelLoadError as exc:
        return str(exc)
    for entry in manifest.files:
        path = folder / entry.path
        size = path.stat().st_size if path.is_file() else None
        if size != entry.size_bytes:
            return f"{entry.path} has {size} bytes, the manifest says {entry.size_bytes}"
        if reverify and hash_file(path)[0] != entry.sha256:
            return f"{entry.path} no longer has sha256 {entry.sha256}"
    return None


def _decoded(raw: bytes, model: str, version: str, where: str) -> Manifest:
    manifest = decode_manifest(raw, where)
    if (manifest.model, manifest.version) != (model, version):
        raise ModelLoadError(
            f"manifest {where} describes {manifest.model} {manifest.version}, not {model} {version}",
            MANIFEST_NAME,
            f"{model} {version}",
        )
    return manifest


def _check_manifest_digest(raw: bytes, expected: str | None, model: str, version: str, where: str) -> None:
    """Raise :class:`ChecksumMismatch` (field ``manifest_sha256``) when ``expected`` is given and the store's
    manifest has another sha256: the version was deleted and pushed again, or replaced, since it was pinned."""
    actual = manifest_digest(raw)
    if expected is not None and actual != expected:
        raise ChecksumMismatch(
            f"manifest of {model} {version} changed since it was pinned (sha256 {expected} pinned, {actual} now, "
            f"{where}); pin it again to accept the new bytes (`fleet models pin {model} {version}`)",
            "manifest_sha256",
            expected,
        )


def _verify(path: Path, entry: ManifestFile, model: str, version: str, source: str) -> None:
    """Raise :class:`ChecksumMismatch` unless ``path`` has ``entry``'s sha256 and size."""
    sha256, size = hash_file(path)
    if sha256 != entry.sha256 or size != entry.size_bytes:
        raise ChecksumMismatch(
            f"{model} {version}: {entry.path} does not match its manifest: sha256 expected {entry.sha256}, "
            f"got {sha256}; size expected {entry.size_bytes} bytes, got {size} (from {source}); "
            "the version was not installed",
            entry.path,
            entry.sha256,
        )


def _install(partial: Path, final: Path) -> None:
    """Rename the verified ``partial`` folder to ``final``. When a racing process got there first, its
    copy (verified just the same) is kept, unless it fails its check: then it is removed and replaced."""
    try:
        partial.rename(final)
        return
    except OSError:
        if not final.exists():
            raise
    if cached_model_file(final, final.parent.name, final.name) is None:
        partial.rename(final)


def _remove(folder: Path) -> None:
    """Move ``folder`` aside (one rename, so it vanishes at once for readers) and delete it."""
    aside = folder.with_name(f".{folder.name}.stale-{process_token()}-{time.monotonic_ns()}")
    try:
        folder.rename(aside)
    except OSError:
        return
    shutil.rmtree(aside, ignore_errors=True)


def _sweep_partials(parent: Path, version: str) -> None:
    """Delete partial and stale folders of ``version`` left by processes that are gone.

    A folder names its process as ``<pid>_<start>`` (:func:`process_token`): a worker restarted in a container
    gets the pid of the one that died there (1, or another small number), and by the pid alone it took
    that one's leftovers for its own, in progress, and never deleted them (the volume filled up over
    restarts). A name of the older form, ``<pid>`` alone, is judged by the pid."""
    for entry in parent.glob(f".{version}.*-*-*"):
        owner = entry.name.split("-")[-2] if entry.name.count("-") >= 2 else ""
        pid, _, start = owner.partition("_")
        if not pid.isdigit() or _alive(int(pid), start):
            continue
        shutil.rmtree(entry, ignore_errors=True)


def process_token() -> str:
    """This process as a folder name records it: ``<pid>_<start>``, its start time in clock ticks after boot
    (``/proc/<pid>/stat``; empty where there is no ``/proc``)."""
    return f"{os.getpid()}_{_start_ticks(os.getpid()) or ''}"


def _start_ticks(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks after boot, field 22 of ``/proc/<pid>/stat``); None when unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # the command name, in parentheses, may hold spaces
    return fields[19] if len(fields) > 19 else None


def _alive(pid: int, start: str = "") -> bool:
    """Whether the process that wrote a folder lives: ``pid`` runs and, where the name recorded it, started when
    the name says (else the pid is another process's now)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return not start or _start_ticks(pid) in (None, start)
