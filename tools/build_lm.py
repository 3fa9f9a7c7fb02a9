"""A GPT-2 style causal LM with KV cache, in optimum's ``text-generation-with-past`` I/O.

Learned position embeddings, pre-LayerNorm blocks with a fused QKV projection and a GELU MLP, all
with biases. Inputs and outputs are those of :mod:`tools.decoder_io` (``kv`` = the ``h`` attention
heads), in the order of optimum's GPT-2 export: ``input_ids``, ``past_key_values.{i}.key/.value``,
``attention_mask``, ``position_ids`` (``position_ids`` values in ``[0, max_positions)``).

The query at absolute position ``past + j`` attends key ``t`` iff ``t <= past + j`` and
``attention_mask[b, t] == 1``. So padding on either side never changes a real token's result, and
a prefill is a call with empty past tensors ``[batch_size, h, 0, d]``. The model's folder also gets
``generation_config.json`` (EOS id 2) and ``tokenizer_config.json`` (chat template):
:mod:`tools.generation_assets`.
"""

from __future__ import annotations

from pathlib import Path

from protocol.tokenization import ByteTokenizer
from tools.decoder_io import LOGIT_STD, check_decoder_sizes, declare_io, lm_head, present, write_decoder
from tools.onnx_graph import GraphBuilder
from tools.onnx_layers import (
    WeightInit,
    attention,
    causal_bias,
    layer_norm,
    linear,
    merge_heads,
    mlp,
    qkv_heads,
)

__all__ = ["LOGIT_STD", "build_causal_lm", "causal_lm_parameter_count"]


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


def _decoder_layer(g: GraphBuilder, init: WeightInit, x: str, bias: str, i: int, *, num_heads: int,
                   hidden: int, intermediate: int) -> str:
    """One pre-LN block: ``x + attn(ln_1(x))`` then ``+ mlp(ln_2(·))``; also emits ``present.{i}.*``."""
    head_dim = hidden // num_heads
    prefix = f"h.{i}"
    normed = layer_norm(g, x, init.norm(f"{prefix}.ln_1", hidden), f"{prefix}.ln_1")
    q, k, v = qkv_heads(g, init, normed, f"{prefix}.attn", num_heads, hidden)
    keys, values = (present(g, i, kind, new, num_heads, head_dim) for kind, new in (("key", k), ("value", v)))
    ctx = attention(g, q, keys, values, bias, f"{prefix}.attn")
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
        eos 2) is next to it with a ``.json`` suffix, the generation assets in its folder.

    Raises:
        ValueError: vocabulary too small for the byte tokenizer, or inconsistent sizes.
    """
    check_decoder_sizes(num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads,
                        vocab_size=vocab_size, max_positions=max_positions)
    inter = intermediate_size or 4 * hidden_size
    g = GraphBuilder(name)
    init = WeightInit(g, seed)
    input_ids, attention_mask, position_ids = declare_io(
        g, num_layers=num_layers, kv_heads=num_heads, head_dim=hidden_size // num_heads, vocab_size=vocab_size,
        past_first=True)

    wte = init.normal("wte.weight", (vocab_size, hidden_size), 1.0)
    wpe = init.normal("wpe.weight", (max_positions, hidden_size), 0.5)
    tok = g.op("Gather", [wte, input_ids], hint="tok_emb", axis=0)
    pos = g.op("Gather", [wpe, position_ids], hint="pos_emb", axis=0)
    x = g.op("Add", [tok, pos], hint="embeddings")
    bias = causal_bias(g, input_ids, attention_mask)
    for i in range(num_layers):
        x = _decoder_layer(g, init, x, bias, i, num_heads=num_heads, hidden=hidden_size, intermediate=inter)
    lm_head(g, init, layer_norm(g, x, init.norm("ln_f", hidden_size), "ln_f"), hidden_size, vocab_size)
    return write_decoder(
        g, out_dir, eos_token_id=ByteTokenizer.eos_token_id, name=name, version=version, vocab_size=vocab_size,
        max_positions=max_positions, num_layers=num_layers, num_heads=num_heads,
        head_dim=hidden_size // num_heads, hidden_size=hidden_size, seed=seed)
