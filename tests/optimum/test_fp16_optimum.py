"""optimum's exports in float16, as ``fleet quantize --target cuda`` writes them, served by both KV caches.

The float16 converter puts ``Cast`` nodes where an op stays float32, and optimum's graphs are not the
fleet's own (GPT-2's attention, Llama's rotary embeddings and grouped heads): the in-place rewrite and
the LM-head-last rewrite must still match them, the probe must pass at the float16 tolerance, and the
in-place cache (with prefix reuse across turns) must give the tokens of the Concat cache. Against
transformers' float32 greedy tokens, float16 may pick another token on a near tie, so that comparison
is the accuracy report's top-1 agreement.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.integration.multiturn import Conversations, make_loop, run_turns
from tools.quantize import quantize_model
from tools.quantize_config import QuantizeConfig

pytestmark = [pytest.mark.optimum, pytest.mark.timeout(900)]

FP16 = QuantizeConfig(mode="fp16", target="cuda", eval_count=32, latency_rounds=1, latency_prompts=4, overwrite=True)


@pytest.mark.parametrize("model", ["hf-llama", "hf-gpt2"])
def test_an_fp16_optimum_export_is_served_in_place_with_the_concat_caches_tokens(
    exports: tuple[Path, dict[str, Any]], model: str
) -> None:
    out, refs = exports
    outcome = quantize_model(out / refs["models"][model]["onnx"], FP16, progress=False)
    assert outcome.path is not None
    assert outcome.report["accuracy"]["top1_agreement"] >= 0.9, outcome.report["accuracy"]
    talk = Conversations(count=6, turns=3, vocab=1000, seed=5)
    concat = make_loop(outcome.path, prefix_cache_bytes=0, kv_cache="concat")
    in_place = make_loop(outcome.path, prefix_cache_bytes=64 << 20, kv_cache="in_place")
    assert in_place.kv.in_place and in_place.kv.cache.dtype == np.float16  # type: ignore[attr-defined]
    assert in_place.decoder.engine.lm_head_last  # the LM-head rewrite matched the float16 graph too
    print(f"\n{model} fp16: probe error {in_place.decoder.probe_error:.1e}, "  # type: ignore[attr-defined]
          f"top-1 agreement with fp32 {outcome.report['accuracy']['top1_agreement']:.3f}")
    assert run_turns(in_place, talk, max_new_tokens=8) == run_turns(concat, talk, max_new_tokens=8)
    assert in_place.prefix_cache is not None and in_place.prefix_cache.hits == talk.count * (talk.turns - 1)
