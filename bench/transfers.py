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
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["measure_transfers"]


def _phase(delta: Any) -> dict[str, Any]:
    return {"h2d_bytes": delta.h2d_bytes, "d2h_bytes": delta.d2h_bytes, "tokens": delta.tokens,
            "steps": delta.decode_steps + delta.prefills, "bytes_per_token": delta.bytes_per_token}  # fmt: skip


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
    # the Concat cache's traffic: what a GPU worker serves (the in-place cache is CPU-only, docs/gpu.md)
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

    step()
    marks.append(decoder.transfers)
    for _ in range(steps - 1):
        step()
    marks.append(decoder.transfers)
    state.relayout(list(range(1, rows)), None, [])
    tokens = tokens[1:]
    step()
    marks.append(decoder.transfers)
    names = ["prefill", "first decode step (cache from numpy)", f"{steps - 1} steady decode steps",
             "step after one row leaves (re-layout)"]  # fmt: skip
    phases = {name: _phase(marks[i + 1].since(marks[i])) for i, name in enumerate(names)}
    total = marks[-1].since(marks[0])
    cache_bytes = int(sum(np.asarray(v).nbytes for v in state.as_numpy().values()))
    return {
        "device": total.device,
        "crossed": total.crossed,
        "providers": list(engine.providers),
        "rows": rows,
        "steps": steps,
        "prompt_tokens": f"{lo}–{hi}",
        "phases": phases,
        "total": _phase(total),
        "cache_bytes_at_end": cache_bytes,
        "note": None if total.crossed else (
            "CPU chain: nothing crossed a bus; the counts are what the same steps would copy on a GPU."),
    }
