"""A bare continuous-batching loop on numpy and ONNX Runtime: what a user writes without a serving stack.

It drives a decoder export as is (the ``text-generation-with-past`` I/O of optimum's Llama and of
``tools/build_llama.py``: ``input_ids``, ``attention_mask``, ``position_ids``, ``past_key_values.*`` in,
``logits`` and ``present.*`` out), with none of the worker's code, so the same-weights rows have a
reference written independently of the fleet:

* the running batch keeps one left-padded past per layer ``[rows, kv_heads, past, head_dim]``; a
  decode step feeds it and keeps the ``present`` it gets back (the graph's own ``Concat``);
* waiting requests join at the next step, up to ``max_batch``: their prompts are prefilled together
  (left-padded, positions counting real tokens), then their pasts are padded to the batch's and
  stacked onto it (the re-layout a join costs);
* a request leaves after its ``max_new_tokens`` (greedy, forced length): its row is dropped, and
  columns no remaining row uses are cut off.

``max_batch = 1`` is the one-at-a-time loop. Times are ``perf_counter`` seconds from the start.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import onnxruntime as ort

__all__ = ["BareRequest", "bare_generate"]


@dataclass
class BareRequest:
    """One request of the loop: its prompt, its forced length, and what it produced."""

    prompt: list[int]
    max_new_tokens: int
    tokens: list[int] = field(default_factory=list)
    first_s: float = float("nan")
    """Start → its first token (s)."""
    done_s: float = float("nan")
    """Start → its last token (s)."""


def _past_names(session: ort.InferenceSession) -> list[str]:
    return [i.name for i in session.get_inputs() if i.name.startswith("past_key_values.")]


def _pad_left(past: np.ndarray, width: int) -> np.ndarray:
    """``past [rows, kv, p, d]`` with zeros before it up to ``width`` positions."""
    missing = width - past.shape[2]
    if missing == 0:
        return past
    pad = np.zeros((past.shape[0], past.shape[1], missing, past.shape[3]), dtype=past.dtype)
    return np.concatenate([pad, past], axis=2)


def _pad_mask(mask: np.ndarray, width: int) -> np.ndarray:
    missing = width - mask.shape[1]
    return mask if missing == 0 else np.concatenate([np.zeros((mask.shape[0], missing), np.int64), mask], axis=1)


class _Batch:
    """The running rows' pasts (per ``past_key_values.*`` name) and attention mask, left-padded."""

    def __init__(self, names: list[str], shape: tuple[int, int]) -> None:
        kv_heads, head_dim = shape
        self.names = names
        self.past = {n: np.zeros((0, kv_heads, 0, head_dim), np.float32) for n in names}
        self.mask = np.zeros((0, 0), np.int64)

    def stack(self, past: dict[str, np.ndarray], mask: np.ndarray) -> None:
        width = max(self.mask.shape[1], mask.shape[1])
        for n in self.names:
            self.past[n] = np.concatenate([_pad_left(self.past[n], width), _pad_left(past[n], width)], axis=0)
        self.mask = np.concatenate([_pad_mask(self.mask, width), _pad_mask(mask, width)], axis=0)

    def keep(self, rows: np.ndarray) -> None:
        """Keep ``rows`` (a boolean per row) and cut the leading columns no kept row uses."""
        self.mask = self.mask[rows]
        used = np.flatnonzero(self.mask.any(axis=0))
        first = int(used[0]) if used.size else self.mask.shape[1]
        self.mask = self.mask[:, first:]
        for n in self.names:
            self.past[n] = self.past[n][rows][:, :, first:]


def _prefill(session: ort.InferenceSession, names: list[str], shape: tuple[int, int],
             prompts: Sequence[Sequence[int]]) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray]:  # fmt: skip
    """Prefill ``prompts`` together (left-padded); their last logits, presents and mask."""
    width = max(len(p) for p in prompts)
    ids = np.zeros((len(prompts), width), np.int64)
    mask = np.zeros((len(prompts), width), np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = prompt
        mask[row, width - len(prompt):] = 1
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    empty = np.zeros((len(prompts), shape[0], 0, shape[1]), np.float32)
    feeds: dict[str, np.ndarray] = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
    feeds |= {n: empty for n in names}
    logits, *presents = session.run(None, feeds)
    return logits[:, -1], dict(zip(names, presents, strict=True)), mask


def bare_generate(session: ort.InferenceSession, work: Sequence[tuple[Sequence[int], int]],
                  max_batch: int) -> tuple[list[BareRequest], float]:  # fmt: skip
    """Generate every ``(prompt, max_new_tokens)`` of ``work`` (all waiting at the start, greedy,
    forced lengths) with at most ``max_batch`` running; the requests and the whole span (s).

    The session's outputs must be ``logits`` then the ``present.*`` in the order of its
    ``past_key_values.*`` inputs (the exports this module describes).
    """
    names = _past_names(session)
    declared = session.get_inputs()[[i.name for i in session.get_inputs()].index(names[0])].shape
    shape = (int(declared[1]), int(declared[3]))
    requests = [BareRequest(list(p), int(n)) for p, n in work]
    waiting = deque(requests)
    running: list[BareRequest] = []
    batch = _Batch(names, shape)
    started = time.perf_counter()
    while waiting or running:
        if waiting and len(running) < max_batch:
            joiners = [waiting.popleft() for _ in range(min(len(waiting), max_batch - len(running)))]
            logits, presents, mask = _prefill(session, names, shape, [r.prompt for r in joiners])
            now = time.perf_counter() - started
            for request, token in zip(joiners, np.argmax(logits, axis=-1), strict=True):
                request.tokens.append(int(token))
                request.first_s = request.done_s = now
            batch.stack(presents, mask)
            running += joiners
        else:
            last = np.array([[r.tokens[-1]] for r in running], np.int64)
            positions = np.array([[len(r.prompt) + len(r.tokens) - 1] for r in running], np.int64)
            mask = np.concatenate([batch.mask, np.ones((len(running), 1), np.int64)], axis=1)
            feeds = {"input_ids": last, "attention_mask": mask, "position_ids": positions, **batch.past}
            logits, *presents = session.run(None, feeds)
            now = time.perf_counter() - started
            for request, token in zip(running, np.argmax(logits[:, -1], axis=-1), strict=True):
                request.tokens.append(int(token))
                request.done_s = now
            batch.past, batch.mask = dict(zip(names, presents, strict=True)), mask
        alive = np.array([len(r.tokens) < r.max_new_tokens for r in running], dtype=bool)
        if not alive.all():
            batch.keep(alive)
            running = [r for r, keep in zip(running, alive, strict=True) if keep]
    return requests, time.perf_counter() - started
