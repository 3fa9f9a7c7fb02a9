"""A GPT-2 style causal LM with KV cache, exported with optimum's ``text-generation-with-past`` I/O.

Graph inputs (``L`` layers, ``h`` heads, ``d`` head dim)::

    input_ids                   int64   [batch_size, sequence_length]
    attention_mask              int64   [batch_size, past_sequence_length + sequence_length]
    position_ids                int64   [batch_size, sequence_length]        values in [0, max_positions)
    past_key_values.{i}.key     float32 [batch_size, h, past_sequence_length, d]    i = 0 … L-1
    past_key_values.{i}.value   float32 [batch_size, h, past_sequence_length, d]

Graph outputs::

    logits                      float32 [batch_size, sequence_length, vocab_size]
    present.{i}.key / .value    float32 [batch_size, h, past_sequence_length + sequence_length, d]

The query at absolute position ``past + j`` attends key ``t`` iff ``t <= past + j`` and
``attention_mask[b, t] == 1``. So right padding never changes a real token's result, and a prefill
is a call with empty past tensors ``[batch_size, h, 0, d]``.
"""

from __future__ import annotations

from pathlib import Path

from onnx import TensorProto

from protocol.modelcard import ModelCard
from protocol.tokenization import ByteTokenizer
from tools.artifacts import card_metadata, write_model
from tools.onnx_graph import GraphBuilder
from tools.onnx_layers import (
    WeightInit,
    additive_bias,
    attention,
    dim,
    layer_norm,
    linear,
    merge_heads,
    mlp,
    padding_allowed,
    qkv_heads,
)

__all__ = ["LOGIT_STD", "build_causal_lm", "causal_lm_parameter_count"]

LOGIT_STD = 4.0
"""Target standard deviation of the logits (units of log-probability): well spread, few near-ties."""

BATCH, SEQ, PAST, TOTAL = "batch_size", "sequence_length", "past_sequence_length", \
    "past_sequence_length + sequence_length"


def causal_lm_parameter_count(*, num_layers: int, hidden_size: int, vocab_size: int, max_positions: int,
                              intermediate_size: int | None = None) -> int:
    """Number of weights :func:`build_causal_lm` creates for these sizes (without building it)."""
    hid, inter = hidden_size, intermediate_size or 4 * hidden_size
    per_layer = (
        2 * hid                        # ln_1
        + hid * 3 * hid + 3 * hid      # fused qkv
        + hid * hid + hid              # attention output
        + 2 * hid                      # ln_2
        + hid * inter + inter          # fc_in
        + inter * hid + hid            # fc_out
    )
    return vocab_size * hid + max_positions * hid + num_layers * per_layer + 2 * hid + hid * vocab_size


def _check_sizes(num_layers: int, hidden_size: int, num_heads: int, vocab_size: int,
                 max_positions: int) -> None:
    if vocab_size < ByteTokenizer.vocab_size:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: the byte tokenizer needs at least "
            f"{ByteTokenizer.vocab_size} ids (pad, bos, eos + 256 bytes)"
        )
    if num_layers < 1 or num_heads < 1 or max_positions < 1:
        raise ValueError("num_layers, num_heads and max_positions must be >= 1")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} is not a multiple of num_heads={num_heads}")


def _causal_bias(g: GraphBuilder, input_ids: str, attention_mask: str) -> str:
    """Float bias ``[B, 1, S, T]``: 0 where query ``j`` may see key ``t``, float32 min elsewhere."""
    seq = dim(g, input_ids, 1, "seq_len")
    total = dim(g, attention_mask, 1, "total_len")
    past = g.op("Sub", [total, seq], hint="past_len")
    one = g.i64(1, "one_i64")
    q_pos = g.op("Range", [past, total, one], hint="query_positions")
    k_pos = g.op("Range", [g.i64(0, "zero_i64"), total, one], hint="key_positions")
    q_col = g.op("Unsqueeze", [q_pos, g.i64([1], "axes_1")], hint="query_col")     # [S, 1]
    k_row = g.op("Unsqueeze", [k_pos, g.i64([0], "axes_0")], hint="key_row")       # [1, T]
    causal = g.op("LessOrEqual", [k_row, q_col], hint="causal")                     # [S, T]
    allowed = g.op("And", [causal, padding_allowed(g, attention_mask)], hint="allowed")  # [B, 1, S, T]
    return additive_bias(g, allowed)


def _decoder_layer(g: GraphBuilder, init: WeightInit, x: str, bias: str, i: int, *, num_heads: int,
                   hidden: int, intermediate: int) -> str:
    """One pre-LN block: ``x + attn(ln_1(x))`` then ``+ mlp(ln_2(·))``; also emits ``present.{i}.*``."""
    head_dim = hidden // num_heads
    prefix = f"h.{i}"
    g.input(f"past_key_values.{i}.key", TensorProto.FLOAT, [BATCH, num_heads, PAST, head_dim])
    g.input(f"past_key_values.{i}.value", TensorProto.FLOAT, [BATCH, num_heads, PAST, head_dim])
    normed = layer_norm(g, x, init.norm(f"{prefix}.ln_1", hidden), f"{prefix}.ln_1")
    q, k, v = qkv_heads(g, init, normed, f"{prefix}.attn", num_heads, hidden)
    for kind, new in (("key", k), ("value", v)):
        name = f"present.{i}.{kind}"
        g.op("Concat", [f"past_key_values.{i}.{kind}", new], outputs=[name], axis=2)
        g.output(name, TensorProto.FLOAT, [BATCH, num_heads, TOTAL, head_dim])
    ctx = attention(g, q, f"present.{i}.key", f"present.{i}.value", bias, f"{prefix}.attn")
    w_o, b_o = init.dense(f"{prefix}.attn.out", hidden, hidden)
    attn_out = linear(g, merge_heads(g, ctx, hidden, f"{prefix}.attn.merge"), w_o, b_o, f"{prefix}.attn.out")
    x = g.op("Add", [x, attn_out], hint=f"{prefix}.resid_attn")
    normed = layer_norm(g, x, init.norm(f"{prefix}.ln_2", hidden), f"{prefix}.ln_2")
    return g.op("Add", [x, mlp(g, init, normed, f"{prefix}.mlp", hidden, intermediate)], hint=f"{prefix}.out")


def build_causal_lm(out_dir: Path, *, name: str = "demo-lm", version: str = "1.0.0", num_layers: int = 2,
                    hidden_size: int = 64, num_heads: int = 4, vocab_size: int = 512,
                    max_positions: int = 512, intermediate_size: int | None = None, seed: int = 0) -> Path:
    """Build a random-weight GPT-2 style LM and write ``<out_dir>/<name>/<name>-<version>.onnx`` + card.

    Args:
        out_dir: root folder of the model store.
        num_layers: decoder blocks; hidden_size: model width; num_heads: attention heads (must divide it).
        vocab_size: logits per position (>= 259 for the byte tokenizer).
        max_positions: rows of the position table: largest past + sequence length (tokens).
        intermediate_size: MLP width (default ``4 * hidden_size``).
        seed: seed of ``numpy.random.default_rng`` for the weights (same seed → identical file).

    Returns:
        Path of the ``.onnx`` file; the card (kind ``causal_lm``, byte tokenizer, pad 0 / bos 1 /
        eos 2) is next to it with a ``.json`` suffix.

    Raises:
        ValueError: vocabulary too small for the byte tokenizer, or inconsistent sizes.
    """
    _check_sizes(num_layers, hidden_size, num_heads, vocab_size, max_positions)
    inter = intermediate_size or 4 * hidden_size
    g = GraphBuilder(name)
    init = WeightInit(g, seed)
    input_ids = g.input("input_ids", TensorProto.INT64, [BATCH, SEQ])
    attention_mask = g.input("attention_mask", TensorProto.INT64, [BATCH, TOTAL])
    position_ids = g.input("position_ids", TensorProto.INT64, [BATCH, SEQ])
    g.output("logits", TensorProto.FLOAT, [BATCH, SEQ, vocab_size])  # first output, as optimum orders them

    wte = init.normal("wte.weight", (vocab_size, hidden_size), 1.0)
    wpe = init.normal("wpe.weight", (max_positions, hidden_size), 0.5)
    tok = g.op("Gather", [wte, input_ids], hint="tok_emb", axis=0)
    pos = g.op("Gather", [wpe, position_ids], hint="pos_emb", axis=0)
    x = g.op("Add", [tok, pos], hint="embeddings")
    bias = _causal_bias(g, input_ids, attention_mask)
    for i in range(num_layers):
        x = _decoder_layer(g, init, x, bias, i, num_heads=num_heads, hidden=hidden_size, intermediate=inter)
    x = layer_norm(g, x, init.norm("ln_f", hidden_size), "ln_f")
    lm_head = init.normal("lm_head.weight", (hidden_size, vocab_size), LOGIT_STD / hidden_size**0.5)
    g.op("MatMul", [x, lm_head], outputs=["logits"])

    card = ModelCard(
        name=name, version=version, kind="causal_lm", vocab_size=vocab_size, max_positions=max_positions,
        num_layers=num_layers, num_heads=num_heads, head_dim=hidden_size // num_heads,
        hidden_size=hidden_size, pad_token_id=ByteTokenizer.pad_token_id,
        bos_token_id=ByteTokenizer.bos_token_id, eos_token_id=ByteTokenizer.eos_token_id,
        tokenizer="byte", parameters=g.parameter_count, seed=seed,
    )
    return write_model(g.build(card_metadata(card)), card, out_dir)
