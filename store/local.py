"""The model store on a local (or mounted) directory: ``<root>/<model>/<version>/<file>``.

Writes go to a temporary file in the target's folder and are renamed into place, so a reader never
sees half a file; an exclusive write or upload links the finished file in (``link`` fails when the name is
taken), which is atomic on every POSIX filesystem, NFS included.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from store.backend import READ_LIMIT_BYTES, Progress, too_large
from store.errors import ObjectExists, ObjectMissing, StoreError
from store.files import CHUNK_BYTES

__all__ = ["LocalBackend"]


class LocalBackend:
    """A directory as the store (see the module docstring); ``root`` is created when missing."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).resolve()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create the store directory {self.root}: {exc}", "store.root", str(root)) from exc

    @property
    def location(self) -> str:
        return str(self.root)

    def url_of(self, key: str) -> str:
        return str(self._path(key))

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if path != self.root and self.root not in path.parents:
            raise StoreError(f"key {key!r} leaves the store directory {self.root}", "key", key)
        return path

    def read(self, key: str, *, max_bytes: int = READ_LIMIT_BYTES) -> bytes | None:
        path = self._path(key)
        try:
            with path.open("rb") as f:
                data = f.read(max_bytes + 1)  # past the limit: refused, whatever the file's size says meanwhile
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
        if len(data) > max_bytes:
            raise too_large(str(path), path.stat().st_size, max_bytes)
        return data

    def _temp_beside(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        return Path(name)

    def write(self, key: str, data: bytes, *, exclusive: bool = False) -> None:
        path = self._path(key)
        tmp = self._temp_beside(path)
        try:
            tmp.write_bytes(data)
            _put_in_place(tmp, path, key, exclusive=exclusive)
        except FileNotFoundError as exc:
            raise _temp_gone(tmp, key) from exc
        finally:
            tmp.unlink(missing_ok=True)

    def upload(self, key: str, source: Path, progress: Progress | None = None, *, exclusive: bool = False) -> int:
        path = self._path(key)
        tmp = self._temp_beside(path)
        try:
            _copy(source, tmp, progress)
            stored = tmp.stat().st_size  # the inode put in place: the name may be replaced right after
            _put_in_place(tmp, path, key, exclusive=exclusive)
        except FileNotFoundError as exc:
            if not source.is_file():
                raise
            raise _temp_gone(tmp, key) from exc
        finally:
            tmp.unlink(missing_ok=True)
        return stored

    def download(self, key: str, dest: Path, progress: Progress | None = None) -> None:
        path = self._path(key)
        if not path.is_file():
            raise ObjectMissing(f"{path} does not exist", key, None)
        try:
            path.open("rb").close()  # the store's side: what fails after this is the destination's
        except OSError as exc:
            raise StoreError(f"cannot read {path}: {exc.strerror or exc}", key, None) from exc
        _copy(path, dest, progress)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def children(self, prefix: str) -> list[str]:
        folder = self._path(prefix) if prefix else self.root
        if not folder.is_dir():
            return []
        return sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))

    def keys(self, prefix: str) -> list[str]:
        """Every file under ``prefix``, a write's temporary file (``.<name>.<random>.tmp``) included: one a push
        that died left is a leftover like any other."""
        folder = self._path(prefix) if prefix else self.root
        if not folder.is_dir():
            return []
        return sorted(str(p.relative_to(self.root)) for p in folder.rglob("*") if p.is_file())

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)


def _temp_gone(tmp: Path, key: str) -> StoreError:
    """The error for a write whose temporary file was removed before it was put in place: another push cleared
    the version (a takeover removes every file under it that its manifest does not name, temporary ones too)."""
    return StoreError(f"{tmp} was removed before it was put in place as {key}: another push (a takeover) cleared "
                      "the version meanwhile; nothing was written", key, None)  # fmt: skip


def _put_in_place(tmp: Path, path: Path, key: str, *, exclusive: bool) -> None:
    """Move the finished ``tmp`` to ``path``; ``exclusive``: link it (fails when the name is taken), else rename.

    Raises:
        ObjectExists: ``exclusive`` and ``path`` exists.
    """
    if not exclusive:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise ObjectExists(f"{path} already exists", key, "absent") from None


def _copy(source: Path, dest: Path, progress: Progress | None) -> None:
    with source.open("rb") as src, dest.open("wb") as out:
        if progress is None:
            shutil.copyfileobj(src, out, CHUNK_BYTES)
            return
        while chunk := src.read(CHUNK_BYTES):
            out.write(chunk)
            progress(len(chunk))
