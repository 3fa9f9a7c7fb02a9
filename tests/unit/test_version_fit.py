"""Which versions fit their model (:mod:`protocol.version_fit`): a table of card changes, no I/O."""

from __future__ import annotations

from typing import Any

import pytest

from protocol.errors import IncompatibleVersion, InvalidRequest
from protocol.modelcard import ModelCard
from protocol.version_fit import RULE, incompatibility, mismatches

LM = ModelCard(name="demo-lm", version="1.0.0", kind="causal_lm", vocab_size=512, max_positions=512, num_layers=2,
               num_heads=4, head_dim=16, hidden_size=64)
ENCODER = ModelCard(name="demo-encoder", version="1.0.0", kind="encoder", vocab_size=1024, max_positions=512,
                    num_layers=2, num_heads=4, head_dim=16, hidden_size=64)


def _lm(**changes: Any) -> ModelCard:
    return LM.model_copy(update=changes)


def _encoder(**changes: Any) -> ModelCard:
    return ENCODER.model_copy(update=changes)


@pytest.mark.parametrize(("model_card", "version_card", "fields"), [
    # what versions are for: new weights, another precision, a longer context, other labels
    (LM, _lm(version="2.0.0", seed=7, parameters=123, quantization="int8-dynamic"), []),
    (LM, _lm(max_positions=1024, eos_token_id=3, pad_token_id=1, tokenizer="tokenizer.json"), []),
    (LM, _lm(num_kv_heads=4), []),  # 4 KV heads written out = num_heads
    (LM, _lm(hidden_size=128, num_heads=8, num_kv_heads=4), []),  # wider, with the same KV layout
    (ENCODER, _encoder(num_layers=6, num_heads=8, head_dim=8, max_positions=2048), []),
    # another kind: reported alone
    (LM, ENCODER, ["kind"]),
    (ENCODER, LM, ["kind"]),
    # what the model's producers validate and size against
    (LM, _lm(vocab_size=1024), ["vocab_size"]),
    (LM, _lm(vocab_size=256), ["vocab_size"]),
    (LM, _lm(max_positions=256), ["max_positions"]),
    (ENCODER, _encoder(vocab_size=512, max_positions=128), ["vocab_size", "max_positions"]),
    # a causal LM's KV layout, an encoder's embedding length
    (LM, _lm(num_layers=3), ["num_layers"]),
    (LM, _lm(num_layers=0), ["num_layers"]),
    (LM, _lm(num_kv_heads=2), ["kv_heads"]),
    (LM, _lm(head_dim=32), ["head_dim"]),
    (ENCODER, _encoder(hidden_size=128), ["hidden_size"]),
])  # fmt: skip
def test_mismatches(model_card: ModelCard, version_card: ModelCard, fields: list[str]) -> None:
    assert [m.field for m in mismatches(model_card, version_card)] == fields


def test_the_refusal_names_the_model_the_version_and_the_mismatch_in_one_line() -> None:
    error = incompatibility("demo-lm", "2.0.0", LM, ENCODER)
    assert isinstance(error, IncompatibleVersion) and isinstance(error, InvalidRequest)  # exit 2 in the CLI
    assert str(error) == f"demo-lm 2.0.0 is an encoder model (embeddings); demo-lm is a causal_lm: {RULE}"
    assert (error.field, error.limit) == ("kind", "causal_lm")
    assert "\n" not in str(error)

    error = incompatibility("demo-lm", "2.1.0", LM, _lm(vocab_size=1024, max_positions=128))
    assert error is not None and (error.field, error.limit) == ("vocab_size", 512)
    assert str(error).startswith("demo-lm 2.1.0 does not fit demo-lm: vocab_size 1024 (the model's: 512); "
                                 "max_positions 128 (the model's: at least 512): a version must have")
    assert incompatibility("demo-lm", "2.2.0", LM, _lm(version="2.2.0")) is None
