"""A version's manifest: what was published, file by file (pure: no I/O beyond the bytes given).

``<model>/<version>/manifest.json`` is written last, after every file it lists; a version without
one is not published. It holds each file's sha256 and size, the model's kind, precision and limits,
and who published it when::

    {"schema_version": 1, "model": "demo-lm", "version": "1.2.3", "model_file": "demo-lm-1.0.0.onnx",
     "card_version": "1.0.0", "kind": "causal_lm", "precision": "fp32", "quantization": null,
     "limits": {"max_positions": 512, "vocab_size": 512},
     "files": [{"path": "demo-lm-1.0.0.onnx", "role": "model", "sha256": "…", "size_bytes": 803079}, …],
     "total_bytes": 803416, "created_at": "2026-12-03T14:08:37Z", "created_unix_s": 1796306917.0,
     "created_by": "alice@host"}

Names (model, version) and file paths are checked here, so a manifest can never make a reader
write outside the version's folder (no ``..``, no absolute path, no backslash).
"""

from __future__ import annotations

import hashlib
import json
import re
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from protocol.errors import InvalidRequest, ModelLoadError
from protocol.modelcard import ModelCard, ModelKind

__all__ = [
    "MANIFEST_NAME",
    "FileRole",
    "Manifest",
    "ManifestFile",
    "ManifestLimits",
    "Precision",
    "check_name",
    "decode_manifest",
    "encode_manifest",
    "manifest_digest",
    "precision_for",
    "version_sort_key",
]

MANIFEST_NAME = "manifest.json"
"""The manifest's object name inside ``<model>/<version>/``."""

Precision = Literal["fp32", "fp16", "int8"]
FileRole = Literal[
    "model", "external_data", "card", "config", "tokenizer", "tokenizer_config", "generation_config",
    "chat_template", "report",
]  # fmt: skip

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def check_name(value: str, field: str) -> str:
    """``value`` when it is a usable model or version name (one path segment), else raise.

    Allowed: 1-128 characters of ``A-Z a-z 0-9 . _ + -``, starting with a letter or digit (so
    ``1.2.3``, ``1.2.3-int8``, ``demo-lm`` pass; ``..``, ``a/b``, ``.hidden`` do not).

    Raises:
        InvalidRequest: (``field``) the name breaks that rule.
    """
    try:
        return _name(value)
    except ValueError as exc:
        raise InvalidRequest(f"{field} {exc}", field, _NAME.pattern) from None


def _name(value: str) -> str:
    if not _NAME.fullmatch(value) or ".." in value:
        raise ValueError(
            f"{value!r} is not a valid name: 1-128 of A-Z a-z 0-9 . _ + -, starting with a letter or digit, no '..'"
        )
    return value


def _relative_path(value: str) -> str:
    parts = value.split("/")
    if not value or value.startswith("/") or "\\" in value or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"{value!r} is not a plain relative path (no '..', no leading '/', no backslash)")
    return value


def _sha256_hex(value: str) -> str:
    if not _SHA256.fullmatch(value):
        raise ValueError("must be 64 lower-case hex digits")
    return value


class ManifestFile(BaseModel):
    """One file of a version: its path relative to the version's folder, what it is, its digest."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: Annotated[str, AfterValidator(_relative_path)]
    role: FileRole
    sha256: Annotated[str, AfterValidator(_sha256_hex)]
    size_bytes: int = Field(ge=0)


class ManifestLimits(BaseModel):
    """The model's own limits, from its card."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_positions: int = Field(gt=0, description="Largest past+sequence length (tokens).")
    vocab_size: int = Field(gt=0)


class Manifest(BaseModel):
    """What one published version holds; see the module docstring."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: Literal[1] = 1
    model: Annotated[str, AfterValidator(_name)]
    version: Annotated[str, AfterValidator(_name)]
    model_file: Annotated[str, AfterValidator(_relative_path)]
    card_version: str
    kind: ModelKind
    precision: Precision
    quantization: str | None = None
    limits: ManifestLimits
    files: tuple[ManifestFile, ...]
    total_bytes: int = Field(ge=0)
    created_at: str = Field(description="UTC, ISO 8601 (wall time: for people, never for deadlines).")
    created_unix_s: float
    created_by: str = Field(description="user@host that published it.")

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        paths = [f.path for f in self.files]
        if len(set(paths)) != len(paths):
            raise ValueError("files lists a path twice")
        hidden = [p for p in paths if p == MANIFEST_NAME or any(part.startswith(".") for part in p.split("/"))]
        if hidden:  # the cache keeps its own manifest.json and dot-files beside the version's files
            raise ValueError(f"files may not hold {MANIFEST_NAME} or dot-files: {hidden[0]!r}")
        if [f.path for f in self.files if f.role == "model"] != [self.model_file]:
            raise ValueError(f"model_file {self.model_file!r} must be the one file with role 'model'")
        if self.total_bytes != sum(f.size_bytes for f in self.files):
            raise ValueError("total_bytes is not the sum of the files' sizes")
        return self

    def file(self, path: str) -> ManifestFile:
        """The entry for ``path``; KeyError when the manifest has none."""
        for entry in self.files:
            if entry.path == path:
                return entry
        raise KeyError(path)

    def summary(self) -> dict[str, Any]:
        """The short form ``fleet models list`` prints per version."""
        return {
            "version": self.version,
            "kind": self.kind,
            "precision": self.precision,
            "model_file": self.model_file,
            "files": len(self.files),
            "total_bytes": self.total_bytes,
            "created_at": self.created_at,
            "created_by": self.created_by,
        }

    @classmethod
    def build(
        cls,
        *,
        model: str,
        version: str,
        card: ModelCard,
        files: list[ManifestFile],
        created_by: str,
        now_unix_s: float,
    ) -> Manifest:
        """A manifest for ``files`` (one with role ``model``) of a model described by ``card``.

        Raises:
            InvalidRequest: a bad name, or the card's quantization maps to no known precision.
            ValueError: the files are inconsistent (two with one path, not exactly one model file).
        """
        model_files = [f.path for f in files if f.role == "model"]
        return cls(
            model=check_name(model, "model"),
            version=check_name(version, "version"),
            model_file=model_files[0] if len(model_files) == 1 else "",
            card_version=card.version,
            kind=card.kind,
            precision=precision_for(card),
            quantization=card.quantization,
            limits=ManifestLimits(max_positions=card.max_positions, vocab_size=card.vocab_size),
            files=tuple(sorted(files, key=lambda f: f.path)),
            total_bytes=sum(f.size_bytes for f in files),
            created_at=datetime.fromtimestamp(now_unix_s, UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            created_unix_s=now_unix_s,
            created_by=created_by,
        )


def precision_for(card: ModelCard) -> Precision:
    """The precision a card's ``quantization`` names: none (or fp32) → ``fp32``, ``fp16``/``float16``
    → ``fp16``, anything starting ``int8`` (``int8-dynamic``, ``int8-static-qdq``) → ``int8``.

    Raises:
        InvalidRequest: (field ``quantization``) any other value.
    """
    label = (card.quantization or "").strip().lower()
    if label in ("", "fp32", "float32", "none"):
        return "fp32"
    if label in ("fp16", "float16", "half") or label.startswith("fp16-"):
        return "fp16"
    if label.startswith("int8"):
        return "int8"
    raise InvalidRequest(
        f"card quantization {card.quantization!r} names no known precision (fp32, fp16, int8…)",
        "quantization",
        "fp32|fp16|int8*",
    )


def encode_manifest(manifest: Manifest) -> bytes:
    """The manifest's bytes as stored (indented JSON, fields in declaration order, newline-terminated)."""
    return (manifest.model_dump_json(indent=2) + "\n").encode()


def manifest_digest(raw: bytes) -> str:
    """sha256 of a manifest's stored bytes (what a pin can record to detect a replaced manifest)."""
    return hashlib.sha256(raw).hexdigest()


def decode_manifest(raw: bytes, where: str) -> Manifest:
    """Parse a manifest's stored bytes; ``where`` names it in errors (e.g. ``s3://b/m/v/manifest.json``).

    Raises:
        ModelLoadError: (field ``manifest.json``) not JSON, or not a valid manifest (names the key).
    """
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"manifest {where} is not valid JSON: {exc}", MANIFEST_NAME, where) from exc
    try:
        return Manifest.model_validate(doc)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'manifest'}: {e['msg']}" for e in exc.errors())
        raise ModelLoadError(f"manifest {where} is invalid: {problems}", MANIFEST_NAME, where) from exc


def version_sort_key(version: str) -> tuple[tuple[int, int | str], ...]:
    """Natural order for version names: ``1.2.10`` after ``1.2.9``, numbers before words."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"[.+_-]", version))
