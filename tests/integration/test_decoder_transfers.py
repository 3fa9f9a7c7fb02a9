"""The generation decoder's device and transfer meter on real models and a real CPU session.

The meter's counts are checked against the arrays that cross, computed here from the card and the
batch shapes (and, for a cache re-laid out into numpy, from the arrays the next step binds): on a
CPU session nothing is copied and the counts are what a GPU session would copy.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from protocol.modelcard import load_card
from protocol.settings import BatchingSettings, EngineSettings, LimitSettings
from workers.engine import Engine
from workers.generation.decoder import Decoder, KVState, Transfers, decoder_device

I64, F32 = 8, 4  # bytes per element


def _decoder(model_dir: Path, name: str, *, lm_head_last: bool) -> Decoder:
    path = model_dir / name / f"{name}-1.0.0.onnx"
    settings = EngineSettings(
        providers=["CPUExecutionProvider"], warmup=False, lm_head_last=lm_head_last, intra_op_threads=1,
        kv_cache="concat",  # this file measures the Concat cache's traffic (the in-place one: test_inplace_kv.py)
    )
    return Decoder(Engine(path, load_card(path), settings, BatchingSettings(), LimitSettings(max_input_tokens=64)))


def _numpy_cache_bytes(state: KVState) -> int:
    """Bytes of the cache arrays the next decode binds from the host (those not kept as OrtValues)."""
    return sum(v.nbytes for v in state.values.values() if isinstance(v, np.ndarray))


def test_a_cpu_session_binds_on_cpu_and_meters_nothing_before_a_step(model_dir: Path) -> None:
    decoder = _decoder(model_dir, "demo-llama", lm_head_last=False)
    session = decoder.session
    assert decoder_device(session.get_providers(), session.get_provider_options()) == ("cpu", 0)
    assert decoder.device == ("cpu", 0)
    assert decoder.transfers == Transfers("cpu", 0, 0, 0, 0, 0)
    assert not decoder.transfers.crossed


@pytest.mark.parametrize(("name", "lm_head_last"), [("demo-llama", False), ("demo-llama", True), ("demo-lm", False)])
def test_meter_counts_the_arrays_that_cross_and_not_a_cache_kept_in_ort(
    model_dir: Path, name: str, lm_head_last: bool
) -> None:
    decoder = _decoder(model_dir, name, lm_head_last=lm_head_last)
    card = decoder.engine.card
    fed = {i.name for i in decoder.session.get_inputs()} & {"input_ids", "attention_mask", "position_ids"}
    assert fed == {"input_ids", "attention_mask", "position_ids"}
    pasts = 2 * card.num_layers
    assert len(decoder.past_names) == pasts

    def cache_bytes(rows: int, width: int) -> int:
        return pasts * rows * card.kv_heads * width * card.head_dim * F32

    def step_inputs_bytes(rows: int, mask_width: int) -> int:
        return rows * I64 + rows * mask_width * I64 + rows * I64  # ids, mask, positions

    # prefill: 3 prompts right-padded to 6 columns, an empty cache in; logits and the presents out
    prompts = [[5, 6, 7], [9] * 6, [300]]
    rows, width = 3, 6
    prefill = decoder.prefill(prompts)
    logit_width = 1 if decoder.engine.lm_head_last else width
    assert decoder.engine.lm_head_last == lm_head_last
    first = decoder.transfers
    assert first == Transfers(
        "cpu",
        h2d_bytes=3 * rows * width * I64,
        d2h_bytes=rows * logit_width * card.vocab_size * F32 + cache_bytes(rows, width),
        prefills=1,
        decode_steps=0,
        tokens=rows,
    )

    # the rows join (nothing read from ORT), so the first decode binds the re-laid-out cache from the host
    state = KVState()
    state.relayout([], prefill, [0, 1, 2])
    host_cache, mask_width = _numpy_cache_bytes(state), state.mask.shape[1] + 1
    assert host_cache == cache_bytes(rows, state.mask.shape[1])
    decoder.decode(state, [11, 12, 13])
    joined = decoder.transfers.since(first)
    assert joined == Transfers(
        "cpu",
        h2d_bytes=step_inputs_bytes(rows, mask_width) + host_cache,
        d2h_bytes=rows * card.vocab_size * F32,
        prefills=0,
        decode_steps=1,
        tokens=rows,
    )

    # unchanged membership: the cache stays bound as OrtValues, only ids/mask/positions and logits cross
    for step in range(2):
        before, mask_width = decoder.transfers, state.mask.shape[1] + 1
        assert _numpy_cache_bytes(state) == 0
        decoder.decode(state, [14 + step, 15, 16])
        assert decoder.transfers.since(before) == Transfers(
            "cpu", step_inputs_bytes(rows, mask_width), rows * card.vocab_size * F32, 0, 1, rows
        )

    # a row leaves: the re-layout reads the whole running cache out of ORT and the next decode binds
    # the kept rows' cache from the host
    before, running_width = decoder.transfers, state.mask.shape[1]
    state.relayout([0, 2], None, [])
    host_cache, mask_width = _numpy_cache_bytes(state), state.mask.shape[1] + 1
    assert host_cache > 0
    decoder.decode(state, [17, 18])
    assert decoder.transfers.since(before) == Transfers(
        "cpu",
        h2d_bytes=step_inputs_bytes(2, mask_width) + host_cache,
        d2h_bytes=cache_bytes(rows, running_width) + 2 * card.vocab_size * F32,
        prefills=0,
        decode_steps=1,
        tokens=2,
    )
    total = decoder.transfers
    assert (total.prefills, total.decode_steps, total.tokens) == (1, 4, 3 + 3 + 3 + 3 + 2)
    assert total.bytes_per_token == (total.h2d_bytes + total.d2h_bytes) / 14
