"""Versions of one small model whose outputs prove which version computed them, for the lifecycle tests.

``build_version(out_dir, version, scale)``: the identity model (``tools/build_identity.py``'s
graph: ``logits[b, s]`` = one-hot of ``input_ids[b, s]``) with the hot value ``scale`` instead of 1.
Its top-1 token is the input token and its logprob is :func:`top1_logprob` ``(scale)``, different for
every scale: a result's ``top_k[0].logprob`` names the version that computed it.

``fail_on_real_input=True`` adds a ``Gather`` of a 16-entry table by ``input_ids``: it passes the
worker's warm-up (token 3, pad 0) and raises ORT's index-out-of-bounds error for every real text (the
byte tokenizer's ids of printable characters are >= 35): a canary that fails at run time.
"""

from __future__ import annotations

import math
from pathlib import Path

from onnx import TensorProto

from protocol.modelcard import ModelCard
from protocol.tokenization import ByteTokenizer
from tools.artifacts import card_metadata, write_model
from tools.onnx_graph import GraphBuilder

__all__ = ["MODEL", "VOCAB", "build_version", "top1_logprob"]

MODEL = "identity"
VOCAB = 512
BATCH, SEQ = "batch_size", "sequence_length"
TABLE = 16
"""Entries of the failing version's lookup table: token ids >= this raise at run time."""


def top1_logprob(scale: float) -> float:
    """log softmax of the hot entry: scale - log(e^scale + VOCAB - 1)."""
    return scale - math.log(math.exp(scale) + VOCAB - 1)


def build_version(out_dir: Path, version: str, scale: float, *, fail_on_real_input: bool = False) -> Path:
    """Write ``<out_dir>/identity/identity-<version>.onnx`` and its card; returns the ``.onnx`` path."""
    g = GraphBuilder(MODEL)
    input_ids = g.input("input_ids", TensorProto.INT64, [BATCH, SEQ])
    g.input("attention_mask", TensorProto.INT64, [BATCH, SEQ])
    g.input("position_ids", TensorProto.INT64, [BATCH, SEQ])
    hot = g.op("OneHot", [input_ids, g.i64([VOCAB], "depth"), g.f32([0.0, scale], "off_on")], axis=-1)
    if fail_on_real_input:
        looked_up = g.op("Gather", [g.f32([0.0] * TABLE, "table"), input_ids], axis=0)
        zero = g.op("Mul", [g.op("Unsqueeze", [looked_up, g.i64([-1], "last")]), g.f32(0.0, "zero")])
        g.op("Add", [hot, zero], outputs=["logits"])
    else:
        g.op("Identity", [hot], outputs=["logits"])
    g.output("logits", TensorProto.FLOAT, [BATCH, SEQ, VOCAB])
    card = ModelCard(
        name=MODEL, version=version, kind="causal_lm", vocab_size=VOCAB, max_positions=4096, num_layers=0,
        num_heads=1, head_dim=1, hidden_size=1, pad_token_id=ByteTokenizer.pad_token_id,
        bos_token_id=ByteTokenizer.bos_token_id, eos_token_id=ByteTokenizer.eos_token_id, tokenizer="byte",
        parameters=0, seed=None,
    )
    return write_model(g.build(card_metadata(card)), card, out_dir / version)
