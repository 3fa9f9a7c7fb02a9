"""Run a built decoder (GPT-style or Llama-style) by name, and batch token sequences the three ways.

Shared by the builder tests; the worker has its own padding code, which these helpers do not replace.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnxruntime as ort

from protocol.modelcard import ModelCard

__all__ = ["F32", "I64", "Decoder", "left_pad", "random_ids", "right_pad", "session"]

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]


def session(path: Path) -> ort.InferenceSession:
    """A CPU session with every graph optimization on (what the worker runs), 2 threads."""
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = 2
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


class Decoder:
    """One model file and its card; :meth:`run` feeds inputs by name, whatever the graph's order."""

    def __init__(self, path: Path, card: ModelCard) -> None:
        self.path, self.card, self.sess = path, card, session(path)

    def run(self, ids: I64, mask: I64, pos: I64, past: Sequence[F32] | None = None) -> tuple[F32, list[F32]]:
        """(logits, presents in ``past_key_values`` order); ``past=None`` is an empty cache."""
        card = self.card
        if past is None:
            past = [np.zeros((ids.shape[0], card.kv_heads, 0, card.head_dim), np.float32)] * (2 * card.num_layers)
        feed: dict[str, npt.NDArray[np.generic]] = {"input_ids": ids, "attention_mask": mask, "position_ids": pos}
        names = []
        for i in range(card.num_layers):
            for j, kind in enumerate(("key", "value")):
                feed[f"past_key_values.{i}.{kind}"] = past[2 * i + j]
                names.append(f"present.{i}.{kind}")
        logits, *presents = self.sess.run(["logits", *names], feed)
        return logits, presents


def random_ids(rng: np.random.Generator, shape: tuple[int, ...], vocab: int) -> I64:
    """Ordinary ids (no pad/bos/eos) of ``shape``."""
    return rng.integers(3, vocab, shape, dtype=np.int64)


def right_pad(seqs: Sequence[I64]) -> tuple[I64, I64, I64]:
    """Batch ``seqs`` with pad id 0, mask 0 and position 0 after each sequence's end."""
    width = max(len(s) for s in seqs)
    ids, mask, pos = (np.zeros((len(seqs), width), np.int64) for _ in range(3))
    for b, seq in enumerate(seqs):
        ids[b, : len(seq)], mask[b, : len(seq)], pos[b, : len(seq)] = seq, 1, np.arange(len(seq))
    return ids, mask, pos


def left_pad(seqs: Sequence[I64]) -> tuple[I64, I64, I64]:
    """Batch ``seqs`` right-aligned: pad id 0, mask 0 and position 0 before each sequence's start."""
    width = max(len(s) for s in seqs)
    ids, mask, pos = (np.zeros((len(seqs), width), np.int64) for _ in range(3))
    for b, seq in enumerate(seqs):
        start = width - len(seq)
        ids[b, start:], mask[b, start:], pos[b, start:] = seq, 1, np.arange(len(seq))
    return ids, mask, pos
