"""The last-position LM-head variant serves the same next-token results through the engine."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from protocol.modelcard import load_card
from protocol.settings import BatchingSettings, EngineSettings, LimitSettings
from tools.lm_head_last import main as rewrite
from workers.engine import Engine
from workers.padding import pad_batch
from workers.postprocess import last_positions, top_k_logprobs


def _engine(path: Path) -> Engine:
    return Engine(path, load_card(path), EngineSettings(providers=["CPUExecutionProvider"], warmup=False),
                  BatchingSettings(), LimitSettings(max_input_tokens=64))


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
