"""Where built models go and how they are written: ``<out_dir>/<name>/<name>-<version>.onnx`` + card."""

from __future__ import annotations

import re
from pathlib import Path

import onnx

from protocol.modelcard import ModelCard, card_path_for

__all__ = ["card_metadata", "model_path", "write_model"]

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


def write_model(model: onnx.ModelProto, card: ModelCard, out_dir: Path) -> Path:
    """Write ``model`` and its card (JSON) to :func:`model_path`; returns the ``.onnx`` path.

    Both files are written to a temporary name first and renamed, so a reader never sees half a file.
    """
    path = model_path(out_dir, card.name, card.version)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".onnx.tmp")
    tmp.write_bytes(model.SerializeToString())
    tmp.replace(path)
    card_file = card_path_for(path)
    tmp_card = card_file.with_suffix(".json.tmp")
    tmp_card.write_text(card.model_dump_json(indent=2) + "\n")
    tmp_card.replace(card_file)
    return path
