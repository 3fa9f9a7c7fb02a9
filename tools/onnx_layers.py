"""Transformer building blocks on top of :class:`~tools.onnx_graph.GraphBuilder`.

Shapes in the docstrings use ``B`` (batch), ``S`` (query tokens), ``T`` (key tokens = past + S),
``H`` (hidden size), ``h`` (heads) and ``d`` (head dim, ``H = h * d``). Every function adds nodes to
the builder and returns the name of the value it computed.

Weights are drawn by :class:`WeightInit` from ``numpy.random.default_rng(seed)`` in the order the
builder asks for them, so the same seed and shape always give byte-identical weights. They are
scaled ~ ``1/sqrt(fan_in)`` (not GPT's 0.02) so activations stay around unit scale and the model's
outputs are well spread: tests compare top-k ids, and near-ties would make that flaky.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from onnx import TensorProto

from tools.onnx_graph import FLOAT_MIN, GraphBuilder

__all__ = [
    "LN_EPSILON",
    "RMS_EPSILON",
    "WeightInit",
    "additive_bias",
    "attention",
    "causal_bias",
    "dim",
    "gelu",
    "layer_norm",
    "linear",
    "merge_heads",
    "mlp",
    "padding_allowed",
    "qkv_heads",
    "repeat_kv",
    "rms_norm",
    "rotary",
    "rotary_tables",
    "split_heads",
    "swiglu_mlp",
]

LN_EPSILON = 1e-5
"""LayerNormalization epsilon of every built model."""

RMS_EPSILON = 1e-6
"""RMSNorm epsilon of the Llama-style models (Llama's ``rms_norm_eps``)."""


class WeightInit:
    """Draws named weights from one seeded generator and adds them to the graph."""

    def __init__(self, g: GraphBuilder, seed: int) -> None:
        self.g = g
        self.rng = np.random.default_rng(seed)

    def normal(self, name: str, shape: Sequence[int], std: float, mean: float = 0.0) -> str:
        """A float32 weight ``name`` of ``shape`` drawn from N(mean, std²)."""
        values = self.rng.standard_normal(tuple(shape), dtype=np.float32) * np.float32(std)
        return self.g.weight(name, values + np.float32(mean))

    def matrix(self, name: str, fan_in: int, fan_out: int, gain: float = 1.0) -> str:
        """Weight ``name`` ``[fan_in, fan_out]`` (``x @ w`` layout) with std ``gain/sqrt(fan_in)``, no bias."""
        return self.normal(name, (fan_in, fan_out), gain / math.sqrt(fan_in))

    def dense(self, prefix: str, fan_in: int, fan_out: int, gain: float = 1.0) -> tuple[str, str]:
        """Weight ``[fan_in, fan_out]`` with std ``gain/sqrt(fan_in)`` and a small bias ``[fan_out]``."""
        w = self.matrix(f"{prefix}.weight", fan_in, fan_out, gain)
        b = self.normal(f"{prefix}.bias", (fan_out,), 0.02)
        return w, b

    def scale(self, name: str, hidden: int) -> str:
        """A norm's scale ``[hidden]`` around 1 (RMSNorm has no bias)."""
        return self.normal(name, (hidden,), 0.1, mean=1.0)

    def norm(self, prefix: str, hidden: int) -> tuple[str, str]:
        """LayerNorm scale (around 1) and bias (around 0), both ``[hidden]``."""
        scale = self.scale(f"{prefix}.weight", hidden)
        return scale, self.normal(f"{prefix}.bias", (hidden,), 0.1)


def dim(g: GraphBuilder, x: str, axis: int, hint: str = "dim") -> str:
    """Scalar int64: the size of ``x`` along ``axis`` (computed at run time)."""
    shape = g.op("Shape", [x], hint=f"{hint}_shape")
    return g.op("Gather", [shape, g.i64(axis, f"axis{axis}")], hint=hint, axis=0)


def linear(g: GraphBuilder, x: str, w: str, b: str | None, hint: str) -> str:
    """``x @ w (+ b)``: ``[..., fan_in] -> [..., fan_out]``."""
    y = g.op("MatMul", [x, w], hint=f"{hint}_matmul")
    return y if b is None else g.op("Add", [y, b], hint=hint)


def layer_norm(g: GraphBuilder, x: str, scale_bias: tuple[str, str], hint: str) -> str:
    """LayerNormalization over the last axis (epsilon :data:`LN_EPSILON`)."""
    return g.op("LayerNormalization", [x, *scale_bias], hint=hint, axis=-1, epsilon=LN_EPSILON)


def gelu(g: GraphBuilder, x: str, hint: str = "gelu") -> str:
    """Exact GELU, ``0.5 * x * (1 + erf(x / sqrt(2)))`` (ONNX Runtime fuses it into one Gelu node)."""
    scaled = g.op("Div", [x, g.f32(math.sqrt(2.0), "sqrt2")], hint=f"{hint}_div")
    erf = g.op("Erf", [scaled], hint=f"{hint}_erf")
    one_plus = g.op("Add", [erf, g.f32(1.0, "one")], hint=f"{hint}_add")
    prod = g.op("Mul", [x, one_plus], hint=f"{hint}_mul")
    return g.op("Mul", [prod, g.f32(0.5, "half")], hint=hint)


def mlp(g: GraphBuilder, init: WeightInit, x: str, prefix: str, hidden: int, intermediate: int) -> str:
    """Feed-forward block ``[B, S, H] -> [B, S, H]``: linear → GELU → linear."""
    w1, b1 = init.dense(f"{prefix}.fc_in", hidden, intermediate)
    w2, b2 = init.dense(f"{prefix}.fc_out", intermediate, hidden)
    up = gelu(g, linear(g, x, w1, b1, f"{prefix}.fc_in"), f"{prefix}.gelu")
    return linear(g, up, w2, b2, f"{prefix}.fc_out")


def rms_norm(g: GraphBuilder, x: str, scale: str, hint: str, epsilon: float = RMS_EPSILON) -> str:
    """RMSNorm over the last axis, ``scale * x / sqrt(mean(x²) + epsilon)`` (no centring, no bias).

    Written as Pow → ReduceMean → Add → Sqrt → Div → Mul, the pattern ONNX Runtime fuses into one
    SimplifiedLayerNormalization node.
    """
    squared = g.op("Pow", [x, g.f32(2.0, "two")], hint=f"{hint}_sq")
    mean = g.op("ReduceMean", [squared], hint=f"{hint}_mean", axes=[-1], keepdims=1)  # axes: attribute in opset 17
    rms = g.op("Sqrt", [g.op("Add", [mean, g.f32(epsilon, "rms_eps")], hint=f"{hint}_eps")], hint=f"{hint}_rms")
    return g.op("Mul", [g.op("Div", [x, rms], hint=f"{hint}_div"), scale], hint=hint)


def swiglu_mlp(g: GraphBuilder, init: WeightInit, x: str, prefix: str, hidden: int, intermediate: int) -> str:
    """Llama's feed-forward block ``[B, S, H] -> [B, S, H]``: ``down(silu(gate(x)) * up(x))``, no biases."""
    gate = linear(g, x, init.matrix(f"{prefix}.gate_proj.weight", hidden, intermediate), None, f"{prefix}.gate")
    up = linear(g, x, init.matrix(f"{prefix}.up_proj.weight", hidden, intermediate), None, f"{prefix}.up")
    silu = g.op("Mul", [gate, g.op("Sigmoid", [gate], hint=f"{prefix}.sigmoid")], hint=f"{prefix}.silu")
    act = g.op("Mul", [silu, up], hint=f"{prefix}.act")
    return linear(g, act, init.matrix(f"{prefix}.down_proj.weight", intermediate, hidden), None, f"{prefix}.down")


def rotary_tables(g: GraphBuilder, position_ids: str, head_dim: int, theta: float) -> tuple[str, str]:
    """``cos`` and ``sin`` ``[B, 1, S, d]`` of rotary embeddings at ``position_ids [B, S]``.

    As Hugging Face's Llama: ``inv_freq[i] = theta^(-2i/d)`` for ``i < d/2``, angle ``= position *
    inv_freq``, and both halves of the last axis repeat the same ``d/2`` angles (rotate-half layout).
    """
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))
    both_halves = np.concatenate([inv_freq, inv_freq]).astype(np.float32)
    pos = g.op("Cast", [position_ids], hint="rope_pos", to=TensorProto.FLOAT)
    pos = g.op("Unsqueeze", [pos, g.i64([-1], "axes_last")], hint="rope_pos_col")              # [B, S, 1]
    angles = g.op("Mul", [pos, g.const(both_halves, np.float32, "rope_inv_freq")], hint="rope_angles")
    angles = g.op("Unsqueeze", [angles, g.i64([1], "axes_1")], hint="rope_angles_heads")      # [B, 1, S, d]
    return g.op("Cos", [angles], hint="rope_cos"), g.op("Sin", [angles], hint="rope_sin")


def rotary(g: GraphBuilder, x: str, tables: tuple[str, str], head_dim: int, hint: str) -> str:
    """``x * cos + rotate_half(x) * sin`` for heads ``x [B, h, S, d]``; ``rotate_half = [-x2, x1]``."""
    cos, sin = tables
    half = g.i64([head_dim // 2, head_dim // 2], "rope_halves")
    x1, x2 = g.op_multi("Split", [x, half], 2, hint=f"{hint}_halves", axis=-1)
    rotated = g.op("Concat", [g.op("Neg", [x2], hint=f"{hint}_neg"), x1], hint=f"{hint}_rot", axis=-1)
    return g.op("Add", [g.op("Mul", [x, cos], hint=f"{hint}_cos"), g.op("Mul", [rotated, sin], hint=f"{hint}_sin")],
                hint=hint)


def repeat_kv(g: GraphBuilder, x: str, kv_heads: int, groups: int, head_dim: int, hint: str) -> str:
    """Grouped-query attention: ``[B, kv, T, d] -> [B, kv * groups, T, d]``, each KV head ``groups`` times
    in a row (query head ``j`` reads KV head ``j // groups``, as Hugging Face's ``repeat_kv``)."""
    if groups == 1:
        return x
    wide = g.op("Unsqueeze", [x, g.i64([2], "axes_2")], hint=f"{hint}_unsq")                  # [B, kv, 1, T, d]
    wide = g.op("Expand", [wide, g.i64([1, 1, groups, 1, 1], f"{hint}_groups")], hint=f"{hint}_expand")
    return g.op("Reshape", [wide, g.i64([0, kv_heads * groups, -1, head_dim], "repeat_kv_shape")], hint=hint)


def split_heads(g: GraphBuilder, x: str, num_heads: int, head_dim: int, hint: str) -> str:
    """``[B, S, H] -> [B, h, S, d]``."""
    shaped = g.op("Reshape", [x, g.i64([0, 0, num_heads, head_dim], "heads_shape")], hint=f"{hint}_reshape")
    return g.op("Transpose", [shaped], hint=hint, perm=[0, 2, 1, 3])


def merge_heads(g: GraphBuilder, x: str, hidden: int, hint: str) -> str:
    """``[B, h, S, d] -> [B, S, H]``."""
    moved = g.op("Transpose", [x], hint=f"{hint}_transpose", perm=[0, 2, 1, 3])
    return g.op("Reshape", [moved, g.i64([0, 0, hidden], "hidden_shape")], hint=hint)


def qkv_heads(g: GraphBuilder, init: WeightInit, x: str, prefix: str, num_heads: int,
              hidden: int) -> tuple[str, str, str]:
    """Query (already scaled by ``1/sqrt(d)``), key and value heads ``[B, h, S, d]`` of ``x [B, S, H]``.

    One fused ``[H, 3H]`` projection, split in three (as GPT-2's ``c_attn``).
    """
    head_dim = hidden // num_heads
    w, b = init.dense(f"{prefix}.qkv", hidden, 3 * hidden)
    fused = linear(g, x, w, b, f"{prefix}.qkv")
    sizes = g.i64([hidden] * 3, "qkv_split")
    q, k, v = g.op_multi("Split", [fused, sizes], 3, hint=f"{prefix}.split", axis=-1)
    q = g.op("Mul", [q, g.f32(1.0 / math.sqrt(head_dim), "attn_scale")], hint=f"{prefix}.q_scaled")
    return (split_heads(g, q, num_heads, head_dim, f"{prefix}.q"),
            split_heads(g, k, num_heads, head_dim, f"{prefix}.k"),
            split_heads(g, v, num_heads, head_dim, f"{prefix}.v"))


def attention(g: GraphBuilder, q: str, k: str, v: str, bias: str, hint: str) -> str:
    """Scaled dot-product attention ``[B, h, S, d]``: ``softmax(q kᵀ + bias) v``.

    ``q`` must be pre-scaled; ``bias`` broadcasts to ``[B, h, S, T]`` (0 where allowed, float32 min
    where masked, so a fully masked row gives a uniform average instead of NaN).
    """
    kt = g.op("Transpose", [k], hint=f"{hint}_kt", perm=[0, 1, 3, 2])
    scores = g.op("MatMul", [q, kt], hint=f"{hint}_scores")
    masked = g.op("Add", [scores, bias], hint=f"{hint}_masked")
    probs = g.op("Softmax", [masked], hint=f"{hint}_probs", axis=-1)
    return g.op("MatMul", [probs, v], hint=hint)


def causal_bias(g: GraphBuilder, input_ids: str, attention_mask: str) -> str:
    """Float bias ``[B, 1, S, T]`` of a decoder with a KV cache: 0 where query ``j`` may see key ``t``.

    Query ``j`` sits at absolute position ``past + j`` (``past = T - S``); it sees key ``t`` iff
    ``t <= past + j`` and ``attention_mask[b, t] == 1``. Elsewhere the bias is float32 min, so padding
    on either side (and holes in the cache) never changes a real token's result.
    """
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


def padding_allowed(g: GraphBuilder, attention_mask: str) -> str:
    """Bool ``[B, 1, 1, T]``: key ``t`` may be attended iff ``attention_mask[b, t] != 0``."""
    as_bool = g.op("Cast", [attention_mask], hint="mask_bool", to=TensorProto.BOOL)
    return g.op("Unsqueeze", [as_bool, g.i64([1, 2], "axes_1_2")], hint="mask_keys")


def additive_bias(g: GraphBuilder, allowed: str) -> str:
    """Float32 bias of the same shape as the bool ``allowed``: 0 where true, float32 min where false."""
    return g.op("Where", [allowed, g.f32(0.0, "zero"), g.f32(FLOAT_MIN, "float_min")], hint="attn_bias")
