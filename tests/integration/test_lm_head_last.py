"""The last-position LM-head variant serves the same next-token results through the engine."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from protocol.modelcard import load_card
from protocol.settings import BatchingSettings, EngineSettings, LimitSettings
from tools.lm_head_last import main as rewrite
from workers.engine import Engine
from workers.generation.decoder import Decoder, KVState
from workers.padding import pad_batch
from workers.postprocess import last_positions, top_k_logprobs


def _engine(path: Path, *, lm_head_last: bool = False) -> Engine:
    settings = EngineSettings(providers=["CPUExecutionProvider"], warmup=False, lm_head_last=lm_head_last,
                              kv_cache="concat")  # drives Decoder + KVState directly
    return Engine(path, load_card(path), settings, BatchingSettings(), LimitSettings(max_input_tokens=64))


def test_last_position_variant_matches_the_full_model(model_dir: Path) -> None:
    full_path = model_dir / "demo-lm" / "demo-lm-1.0.0.onnx"
    assert rewrite([str(full_path)]) == 0
    last_path = full_path.with_name("demo-lm-1.0.0-last.onnx")
    full, last = _engine(full_path), _engine(last_path)
    batch = pad_batch([[5, 6, 7], [9] * 20, [300], [4, 4, 4, 4, 4, 4, 4]])
    out_full, out_last = full.run(batch), last.run(batch)
    assert out_last.shape[1] == 1 and out_full.shape[1] == 20
    ids_f, lp_f = top_k_logprobs(last_positions(out_full, batch.lengths), 5)
    ids_l, lp_l = top_k_logprobs(last_positions(out_last, batch.lengths), 5)
    assert (ids_f == ids_l).all()
    assert np.abs(lp_f - lp_l).max() <= 1e-4


def test_in_memory_rewrite_serves_prefill_and_left_padded_decode_like_the_full_model(model_dir: Path) -> None:
    path = model_dir / "demo-lm" / "demo-lm-1.0.0.onnx"
    full, last = _engine(path), _engine(path, lm_head_last=True)
    assert last.lm_head_last and not full.lm_head_last
    prompts = [[5, 6, 7], [9] * 20, [300]]
    outputs = []
    for engine in (full, last):
        decoder = Decoder(engine)
        prefill = decoder.prefill(prompts)
        state = KVState()
        state.relayout([], prefill, [0, 1, 2])  # rows of 3, 20 and 1 real tokens, left-padded to 20
        logits, _ = decoder.decode(state, [11, 12, 13])
        outputs.append((prefill.last_logits, logits))
    (pre_full, dec_full), (pre_last, dec_last) = outputs
    assert np.abs(pre_full - pre_last).max() <= 1e-4
    assert np.abs(dec_full - dec_last).max() <= 1e-4
