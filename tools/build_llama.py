"""A Llama-style causal LM with KV cache, in optimum's Llama ``text-generation-with-past`` I/O.

As Hugging Face's ``LlamaForCausalLM``: token embeddings (no position table), pre-RMSNorm blocks,
rotary position embeddings driven by ``position_ids`` (rotate-half layout, ``rope_theta``),
grouped-query attention (``num_kv_heads`` KV heads, each shared by ``num_heads / num_kv_heads`` query
heads), a SwiGLU MLP, no biases anywhere, and an untied LM head. Weight names follow Hugging Face's
(``model.layers.{i}.self_attn.q_proj.weight`` …), stored ``[in, out]`` for ``x @ w``.

Inputs and outputs are those of :mod:`tools.decoder_io` with ``kv = num_kv_heads``, in the order of
optimum's Llama export: ``input_ids``, ``attention_mask``, ``position_ids``,
``past_key_values.{i}.key/.value`` (GPT-2's puts the past second). ``present.{i}.key`` holds keys
*after* the rotation, as Hugging Face's cache does. Masking is that of :func:`tools.onnx_layers.causal_bias`:
query ``past + j`` sees key ``t`` iff ``t <= past + j`` and ``attention_mask[b, t] == 1``, so right
padding, left padding and holes never change a real token's result (with ``position_ids`` counting
real tokens only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from protocol.tokenization import ByteTokenizer
from tools.decoder_io import check_decoder_sizes, declare_io, lm_head, present, write_decoder
from tools.onnx_graph import GraphBuilder
from tools.onnx_layers import (
    WeightInit,
    attention,
    causal_bias,
    linear,
    merge_heads,
    repeat_kv,
    rms_norm,
    rotary,
    rotary_tables,
    split_heads,
    swiglu_mlp,
)

__all__ = ["ROPE_THETA", "build_llama", "llama_parameter_count", "swiglu_width"]

ROPE_THETA = 10_000.0
"""Base of the rotary frequencies (Llama 2's ``rope_theta``)."""


def swiglu_width(hidden_size: int) -> int:
    """Default MLP width: ``8/3 * hidden_size`` rounded up to a multiple of 32 (Llama's rule of thumb)."""
    return 32 * math.ceil(8 * hidden_size / 3 / 32)


def llama_parameter_count(*, num_layers: int, hidden_size: int, num_heads: int, vocab_size: int,
                          num_kv_heads: int | None = None, intermediate_size: int | None = None,
                          max_positions: int = 0) -> int:
    """Number of weights :func:`build_llama` creates for these sizes (without building it).

    ``max_positions`` is accepted for symmetry with the other builders; rotary embeddings have no table.
    """
    hid, inter = hidden_size, intermediate_size or swiglu_width(hidden_size)
    kv_width = (num_kv_heads or num_heads) * (hidden_size // num_heads)
    per_layer = (
        2 * hid                              # input_layernorm, post_attention_layernorm
        + 2 * hid * hid                      # q_proj, o_proj
        + 2 * hid * kv_width                 # k_proj, v_proj
        + 3 * hid * inter                    # gate_proj, up_proj, down_proj
    )
    return vocab_size * hid + num_layers * per_layer + hid + hid * vocab_size


@dataclass(frozen=True)
class _Sizes:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int


def _attention(g: GraphBuilder, init: WeightInit, x: str, i: int, bias: str, rope: tuple[str, str],
               s: _Sizes) -> str:
    """Grouped-query self-attention of layer ``i`` on normed ``x [B, S, H]``; emits ``present.{i}.*``."""
    prefix = f"model.layers.{i}.self_attn"
    heads = {}
    for proj, count in (("q", s.heads), ("k", s.kv_heads), ("v", s.kv_heads)):
        w = init.matrix(f"{prefix}.{proj}_proj.weight", s.hidden, count * s.head_dim)
        flat = linear(g, x, w, None, f"{prefix}.{proj}_proj")
        heads[proj] = split_heads(g, flat, count, s.head_dim, f"{prefix}.{proj}")
    q = rotary(g, heads["q"], rope, s.head_dim, f"{prefix}.q_rope")
    q = g.op("Mul", [q, g.f32(1.0 / math.sqrt(s.head_dim), "attn_scale")], hint=f"{prefix}.q_scaled")
    k = rotary(g, heads["k"], rope, s.head_dim, f"{prefix}.k_rope")
    groups = s.heads // s.kv_heads
    keys, values = (
        repeat_kv(g, present(g, i, kind, new, s.kv_heads, s.head_dim), s.kv_heads, groups, s.head_dim,
                  f"{prefix}.{kind}_groups")
        for kind, new in (("key", k), ("value", heads["v"]))
    )
    ctx = attention(g, q, keys, values, bias, f"{prefix}.attn")
    w_o = init.matrix(f"{prefix}.o_proj.weight", s.heads * s.head_dim, s.hidden)
    return linear(g, merge_heads(g, ctx, s.heads * s.head_dim, f"{prefix}.merge"), w_o, None, f"{prefix}.o_proj")


def _decoder_layer(g: GraphBuilder, init: WeightInit, x: str, i: int, bias: str, rope: tuple[str, str],
                   s: _Sizes) -> str:
    """``x + attn(rms_1(x))`` then ``+ mlp(rms_2(·))``."""
    prefix = f"model.layers.{i}"
    normed = rms_norm(g, x, init.scale(f"{prefix}.input_layernorm.weight", s.hidden), f"{prefix}.input_norm")
    x = g.op("Add", [x, _attention(g, init, normed, i, bias, rope, s)], hint=f"{prefix}.resid_attn")
    normed = rms_norm(g, x, init.scale(f"{prefix}.post_attention_layernorm.weight", s.hidden), f"{prefix}.post_norm")
    mlp_out = swiglu_mlp(g, init, normed, f"{prefix}.mlp", s.hidden, s.intermediate)
    return g.op("Add", [x, mlp_out], hint=f"{prefix}.out")


def build_llama(out_dir: Path, *, name: str = "demo-llama", version: str = "1.0.0", num_layers: int = 2,
                hidden_size: int = 64, num_heads: int = 4, num_kv_heads: int | None = 2, vocab_size: int = 512,
                max_positions: int = 512, intermediate_size: int | None = None, rope_theta: float = ROPE_THETA,
                seed: int = 0) -> Path:
    """Build a random-weight Llama-style LM and write ``<out_dir>/<name>/<name>-<version>.onnx`` + card.

    Args:
        out_dir: root folder of the model store.
        num_layers: decoder blocks; hidden_size: model width; num_heads: query heads (must divide it).
        num_kv_heads: KV heads (must divide ``num_heads``; None = ``num_heads``, plain multi-head).
        vocab_size: logits per position (>= 259 for the byte tokenizer).
        max_positions: largest past + sequence length the card admits (tokens); rotary embeddings
            themselves have no table.
        intermediate_size: SwiGLU width (default :func:`swiglu_width`).
        rope_theta: base of the rotary frequencies.
        seed: seed of ``numpy.random.default_rng`` for the weights (same seed → identical file).

    Returns:
        Path of the ``.onnx`` file; the card (kind ``causal_lm``, ``num_kv_heads``, byte tokenizer,
        pad 0 / bos 1 / eos 2) is next to it, ``generation_config.json`` (``eos_token_id: [2]``) and
        ``tokenizer_config.json`` in its folder.

    Raises:
        ValueError: vocabulary too small for the byte tokenizer, or inconsistent sizes (heads not
            dividing the width, KV heads not dividing the heads, an odd head dim).
    """
    check_decoder_sizes(num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads,
                        vocab_size=vocab_size, max_positions=max_positions, num_kv_heads=num_kv_heads)
    s = _Sizes(hidden=hidden_size, heads=num_heads, kv_heads=num_kv_heads or num_heads,
               head_dim=hidden_size // num_heads, intermediate=intermediate_size or swiglu_width(hidden_size))
    if s.head_dim % 2:
        raise ValueError(f"head_dim={s.head_dim} must be even for rotary embeddings")
    g = GraphBuilder(name)
    init = WeightInit(g, seed)
    input_ids, attention_mask, position_ids = declare_io(
        g, num_layers=num_layers, kv_heads=s.kv_heads, head_dim=s.head_dim, vocab_size=vocab_size, past_first=False)

    embed = init.normal("model.embed_tokens.weight", (vocab_size, hidden_size), 1.0)
    x = g.op("Gather", [embed, input_ids], hint="embeddings", axis=0)
    bias = causal_bias(g, input_ids, attention_mask)
    rope = rotary_tables(g, position_ids, s.head_dim, rope_theta)
    for i in range(num_layers):
        x = _decoder_layer(g, init, x, i, bias, rope, s)
    x = rms_norm(g, x, init.scale("model.norm.weight", hidden_size), "model.norm")
    lm_head(g, init, x, hidden_size, vocab_size)
    # A list, as Llama 3's generation_config writes it: the GPT-style model keeps the plain int.
    return write_decoder(
        g, out_dir, eos_token_id=[ByteTokenizer.eos_token_id], name=name, version=version, vocab_size=vocab_size,
        max_positions=max_positions, num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=s.kv_heads, head_dim=s.head_dim,
        hidden_size=hidden_size, seed=seed)
