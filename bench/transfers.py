"""Bytes the generation decoder copies between host and device per generated token, phase by phase.

Read off :attr:`workers.generation.decoder.Decoder.transfers` (every array bound from the host and
every output fetched to it, counted by the decoder itself) over one scripted sequence of the
continuous-batching loop's operations:

1. **prefill** of ``rows`` prompts together (their first tokens);
2. **first decode step**: the cache was just laid out in numpy, so it goes host → device whole;
3. **steady decode steps** at a fixed membership: the cache stays bound on the device, only token
   ids, mask and positions go up and ``[rows, vocab]`` logits come down;
4. **after a row leaves**: the re-layout reads the whole cache back to the host, and the next
   step sends it up again.

On a CPU chain nothing crosses a bus: the counts are what would cross on a GPU (``crossed`` False).

:func:`measure_inplace_transfers` runs the same script on the in-place cache (slots written where the
model runs): the prefill writes the slots, no step binds the cache from the host, and a row leaving frees
its slot without moving anything.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["measure_inplace_transfers", "measure_transfers"]


def _phase(delta: Any) -> dict[str, Any]:
    return {"h2d_bytes": delta.h2d_bytes, "d2h_bytes": delta.d2h_bytes, "tokens": delta.tokens,
            "steps": delta.decode_steps + delta.prefills, "bytes_per_token": delta.bytes_per_token}  # fmt: skip


def _script(decoder: Any, marks: list[Any], step: Callable[[], None], leave: Callable[[], None], steps: int,
            names: list[str]) -> dict[str, Any]:
    """After the prefill (``marks`` holds the meter before and after it): a first step, ``steps - 1`` more, a row
    leaving and one step; the meter's delta per phase (``names``) and in all."""
    step()
    marks.append(decoder.transfers)
    for _ in range(steps - 1):
        step()
    marks.append(decoder.transfers)
    leave()
    step()
    marks.append(decoder.transfers)
    total = marks[-1].since(marks[0])
    return {
        "device": total.device,
        "crossed": total.crossed,
        "steps": steps,
        "phases": {name: _phase(marks[i + 1].since(marks[i])) for i, name in enumerate(names)},
        "total": _phase(total),
        "note": None if total.crossed else (
            "CPU chain: nothing crossed a bus; the counts are what the same steps would copy on a GPU."),
    }


def measure_transfers(model_path: Path, choice: str, *, rows: int = 8, steps: int = 32,
                      prompt_tokens: tuple[int, int] = (16, 48)) -> dict[str, Any]:  # fmt: skip
    """Run the sequence of the module docstring on ``choice``'s chain; bytes per phase and in all.

    Raises:
        ValueError: ``rows`` < 2 (a row must be able to leave) or ``steps`` < 2.
    """
    from bench.genlimit import load_engine
    from bench.machine import provider_chain_for
    from protocol.modelcard import load_card
    from tools.calibration import synthetic_sequences
    from workers.generation.decoder import Decoder, KVState

    if rows < 2 or steps < 2:
        raise ValueError(f"rows must be ≥ 2 and steps ≥ 2 (got rows={rows}, steps={steps})")
    card = load_card(model_path)
    # the Concat cache's traffic: what a GPU worker serves for a float32 graph (measure_inplace_transfers: FP16)
    engine = load_engine(model_path, card, rows, provider_chain_for(choice), kv_cache="concat")
    decoder = Decoder(engine)
    lo, hi = prompt_tokens
    prompts = synthetic_sequences(rows, vocab_size=card.vocab_size, min_tokens=lo, max_tokens=hi, seed=11)
    state = KVState()
    marks = [decoder.transfers]
    prefill = decoder.prefill([list(p) for p in prompts])
    state.relayout([], prefill, list(range(rows)))
    marks.append(decoder.transfers)
    tokens = [int(t) for t in np.argmax(prefill.last_logits, axis=1)]

    def step() -> None:
        nonlocal tokens
        logits, _ms = decoder.decode(state, tokens)
        tokens = [int(t) for t in np.argmax(logits, axis=1)]

    def leave() -> None:
        nonlocal tokens
        state.relayout(list(range(1, rows)), None, [])
        tokens = tokens[1:]

    names = ["prefill", "first decode step (cache from numpy)", f"{steps - 1} steady decode steps",
             "step after one row leaves (re-layout)"]  # fmt: skip
    result = _script(decoder, marks, step, leave, steps, names)
    cache_bytes = int(sum(np.asarray(v).nbytes for v in state.as_numpy().values()))
    return {**result, "providers": list(engine.providers), "rows": rows, "prompt_tokens": f"{lo}–{hi}",
            "cache_bytes_at_end": cache_bytes}


def measure_inplace_transfers(model_path: Path, choice: str, *, rows: int = 8, steps: int = 32,
                              prompt_tokens: tuple[int, int] = (16, 48)) -> dict[str, Any]:  # fmt: skip
    """:func:`measure_transfers`' script on the in-place cache the worker would serve for ``model_path`` on
    ``choice``'s chain; ``{"skipped": reason}`` when that chain keeps the Concat cache for it (e.g. a float32
    graph on a GPU).

    Raises:
        ValueError: ``rows`` < 2 or ``steps`` < 2.
    """
    from bench.genlimit import load_engine
    from bench.machine import provider_chain_for
    from protocol.modelcard import load_card
    from tools.calibration import synthetic_sequences
    from workers.generation.inplace_check import open_decoder
    from workers.generation.inplace_decoder import InPlaceDecoder

    if rows < 2 or steps < 2:
        raise ValueError(f"rows must be ≥ 2 and steps ≥ 2 (got rows={rows}, steps={steps})")
    card = load_card(model_path)
    engine = load_engine(model_path, card, rows, provider_chain_for(choice))
    decoder = open_decoder(engine) if engine.kv.in_place else None
    if not isinstance(decoder, InPlaceDecoder):
        return {"skipped": engine.kv.reason or "the in-place probe disagreed", "providers": list(engine.providers)}
    cache = decoder.new_cache(rows)
    slots = cache.take(rows)
    lo, hi = prompt_tokens
    prompts = synthetic_sequences(rows, vocab_size=card.vocab_size, min_tokens=lo, max_tokens=hi, seed=11)
    marks = [decoder.transfers]
    logits, _ms, _padded = decoder.prefill_first(cache, slots, [list(p) for p in prompts])
    marks.append(decoder.transfers)
    tokens = {slot: int(t) for slot, t in zip(slots, np.argmax(logits, axis=1), strict=True)}

    def step() -> None:
        nonlocal tokens
        logits, _ms = decoder.decode_slots(cache, tokens)
        tokens = {slot: int(np.argmax(logits[slot])) for slot in tokens}

    def leave() -> None:
        cache.release(slots[0])  # the first slot's row leaves: a dummy row of the span from now on
        del tokens[slots[0]]

    names = ["prefill (into the slots)", "first decode step", f"{steps - 1} steady decode steps",
             "step after one row leaves (no re-layout)"]  # fmt: skip
    result = _script(decoder, marks, step, leave, steps, names)
    return {**result, "providers": list(engine.providers), "rows": rows, "prompt_tokens": f"{lo}–{hi}",
            "slots": "device" if cache.on_device else "host", "dtype": cache.dtype.name,
            "cache_bytes_at_end": cache.nbytes}
