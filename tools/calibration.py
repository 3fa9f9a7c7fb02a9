"""Token-sequence sets for quantization: JSONL files, seeded synthetic prompts, session feeds.

A calibration (or held-out evaluation) file is JSON Lines, one sequence per line, either a bare
list of token ids or a request-shaped object::

    [1, 72, 101, 108, 108, 111]
    {"input_ids": [1, 87, 111, 114, 108, 100]}

Feeds follow the engine's by-name convention (``input_ids``, ``attention_mask``, ``position_ids``,
``token_type_ids``, empty ``past_key_values.*`` for a prefill), one sequence per batch.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
from onnxruntime.quantization import CalibrationDataReader

from protocol.modelcard import ModelCard

__all__ = [
    "JsonlCalibrationReader",
    "feeds_for",
    "input_names",
    "read_sequences",
    "synthetic_sequences",
    "write_sequences",
]

FIRST_ORDINARY_ID = 3
"""Ids below this are pad/bos/eos in the byte tokenizer; synthetic prompts avoid them."""


def read_sequences(
    path: Path, *, vocab_size: int | None = None, max_tokens: int | None = None
) -> list[list[int]]:
    """Token sequences from a JSONL file (see the module docstring).

    Args:
        vocab_size: when given, every id must lie in ``[0, vocab_size)``.
        max_tokens: when given, longer sequences keep their last ``max_tokens`` ids.

    Raises:
        ValueError: a line is not a list of ints / an object with ``input_ids``, a sequence is empty,
            an id is out of range, or the file holds no sequence; the message names the line.
    """
    out: list[list[int]] = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            doc: Any = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON: {exc}") from exc
        ids = doc.get("input_ids") if isinstance(doc, dict) else doc
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise ValueError(
                f"{path}:{number}: expected a non-empty list of token ids or {{'input_ids': [...]}}"
            )
        if vocab_size is not None and any(t < 0 or t >= vocab_size for t in ids):
            raise ValueError(f"{path}:{number}: token id outside [0, {vocab_size})")
        out.append(ids[-max_tokens:] if max_tokens else ids)
    if not out:
        raise ValueError(f"{path}: no token sequences")
    return out


def write_sequences(path: Path, sequences: Sequence[Sequence[int]]) -> Path:
    """Write ``sequences`` as JSONL (one bare list per line); returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(list(s)) + "\n" for s in sequences))
    return path


def synthetic_sequences(
    count: int, *, vocab_size: int, min_tokens: int, max_tokens: int, seed: int
) -> list[list[int]]:
    """``count`` seeded random sequences, lengths uniform in ``[min_tokens, max_tokens]`` (tokens).

    Ids are drawn from ``[3, vocab_size)`` (no pad/bos/eos). Same arguments → same sequences.

    Raises:
        ValueError: empty length range or a vocabulary without ordinary ids.
    """
    if not 1 <= min_tokens <= max_tokens or vocab_size <= FIRST_ORDINARY_ID:
        raise ValueError(f"need 1 <= min_tokens <= max_tokens and vocab_size > {FIRST_ORDINARY_ID}")
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_tokens, max_tokens + 1, size=count)
    return [rng.integers(FIRST_ORDINARY_ID, vocab_size, size=int(n)).tolist() for n in lengths]


def input_names(model_path: Path) -> list[str]:
    """Graph input names of ``model_path`` (initializers excluded), read without loading weights."""
    graph = onnx.load(str(model_path), load_external_data=False).graph
    initializers = {init.name for init in graph.initializer}
    return [i.name for i in graph.input if i.name not in initializers]


def feeds_for(
    names: Collection[str], card: ModelCard, batch: Sequence[Sequence[int]],
    kv_dtype: type[np.floating[Any]] = np.float32,
) -> dict[str, npt.NDArray[Any]]:
    """Inputs named ``names`` for ``batch``, right-padded with ``card.pad_token_id`` (empty KV cache of
    ``kv_dtype``: the graph's past inputs' type)."""
    width = max(len(s) for s in batch)
    ids = np.full((len(batch), width), card.pad_token_id, dtype=np.int64)
    mask = np.zeros((len(batch), width), dtype=np.int64)
    for row, seq in enumerate(batch):
        ids[row, : len(seq)] = seq
        mask[row, : len(seq)] = 1
    feeds: dict[str, npt.NDArray[Any]] = {"input_ids": ids}
    if "attention_mask" in names:
        feeds["attention_mask"] = mask
    if "position_ids" in names:
        feeds["position_ids"] = np.arange(width, dtype=np.int64)[None, :] * mask
    if "token_type_ids" in names:
        feeds["token_type_ids"] = np.zeros_like(ids)
    for name in names:
        if name.startswith("past_key_values."):
            feeds[name] = np.zeros((len(batch), card.kv_heads, 0, card.head_dim), dtype=kv_dtype)
    return feeds


class JsonlCalibrationReader(CalibrationDataReader):  # type: ignore[misc]
    """Feeds one calibration sequence per ``get_next()`` call (batch 1, no padding)."""

    def __init__(self, names: Collection[str], card: ModelCard, sequences: Sequence[Sequence[int]]) -> None:
        self._feeds: Iterator[dict[str, npt.NDArray[Any]]] = (
            feeds_for(names, card, [seq]) for seq in sequences
        )
        self.count = len(sequences)

    def get_next(self) -> dict[str, npt.NDArray[Any]] | None:
        """The next feed dict, or None when the set is exhausted."""
        return next(self._feeds, None)
