"""A BERT-style encoder, exported with optimum's ``feature-extraction`` I/O.

Graph inputs and output::

    input_ids          int64   [batch_size, sequence_length]
    attention_mask     int64   [batch_size, sequence_length]     1 = real token, 0 = padding
    token_type_ids     int64   [batch_size, sequence_length]     0 or 1
    last_hidden_state  float32 [batch_size, sequence_length, hidden_size]

Attention is bidirectional and masked by ``attention_mask`` (additive float32-min bias); positions are
``0 … sequence_length-1`` inside the graph, so right padding never changes a real token's result.
Blocks are post-LN as in BERT: ``x = LN(x + attn(x))``, ``x = LN(x + mlp(x))``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from onnx import TensorProto

from protocol.modelcard import ModelCard
from protocol.tokenization import ByteTokenizer
from tools.artifacts import card_metadata, model_path, write_model
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
from tools.wordpiece import SPECIAL_TOKENS, train_wordpiece

__all__ = ["TYPE_VOCAB_SIZE", "build_encoder", "encoder_parameter_count"]

TYPE_VOCAB_SIZE = 2
"""Rows of the token-type table (segment A and B)."""

BATCH, SEQ = "batch_size", "sequence_length"


def encoder_parameter_count(*, num_layers: int, hidden_size: int, vocab_size: int, max_positions: int,
                            intermediate_size: int | None = None) -> int:
    """Number of weights :func:`build_encoder` creates for these sizes (without building it)."""
    hid, inter = hidden_size, intermediate_size or 4 * hidden_size
    per_layer = (hid * 3 * hid + 3 * hid) + (hid * hid + hid) + 2 * hid \
        + (hid * inter + inter) + (inter * hid + hid) + 2 * hid
    return (vocab_size + max_positions + TYPE_VOCAB_SIZE) * hid + 2 * hid + num_layers * per_layer


def _encoder_layer(g: GraphBuilder, init: WeightInit, x: str, bias: str, i: int, *, num_heads: int,
                   hidden: int, intermediate: int) -> str:
    """One post-LN BERT block ``[B, S, H] -> [B, S, H]``."""
    prefix = f"layer.{i}"
    q, k, v = qkv_heads(g, init, x, f"{prefix}.attn", num_heads, hidden)
    ctx = attention(g, q, k, v, bias, f"{prefix}.attn")
    w_o, b_o = init.dense(f"{prefix}.attn.out", hidden, hidden)
    attn_out = linear(g, merge_heads(g, ctx, hidden, f"{prefix}.attn.merge"), w_o, b_o, f"{prefix}.attn.out")
    x = g.op("Add", [x, attn_out], hint=f"{prefix}.resid_attn")
    x = layer_norm(g, x, init.norm(f"{prefix}.attn.ln", hidden), f"{prefix}.attn.ln")
    x = g.op("Add", [x, mlp(g, init, x, f"{prefix}.mlp", hidden, intermediate)], hint=f"{prefix}.resid_mlp")
    return layer_norm(g, x, init.norm(f"{prefix}.out.ln", hidden), f"{prefix}.out.ln")


def _check_sizes(num_layers: int, hidden_size: int, num_heads: int, vocab_size: int,
                 max_positions: int, tokenizer: str) -> None:
    if num_layers < 1 or num_heads < 1 or max_positions < 1:
        raise ValueError("num_layers, num_heads and max_positions must be >= 1")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} is not a multiple of num_heads={num_heads}")
    if tokenizer == "byte" and vocab_size < ByteTokenizer.vocab_size:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: the byte tokenizer needs at least "
            f"{ByteTokenizer.vocab_size} ids (pad, bos, eos + 256 bytes)"
        )
    if tokenizer not in ("byte", "wordpiece"):
        raise ValueError(f"tokenizer must be 'wordpiece' or 'byte', not {tokenizer!r}")


def build_encoder(out_dir: Path, *, name: str = "demo-encoder", version: str = "1.0.0", num_layers: int = 2,
                  hidden_size: int = 64, num_heads: int = 4, vocab_size: int = 1024, max_positions: int = 512,
                  intermediate_size: int | None = None, seed: int = 0,
                  tokenizer: Literal["wordpiece", "byte"] = "wordpiece") -> Path:
    """Build a random-weight BERT-style encoder and write ``<out_dir>/<name>/<name>-<version>.onnx`` + card.

    Args:
        out_dir: root folder of the model store.
        num_layers: encoder blocks; hidden_size: model width; num_heads: attention heads (must divide it).
        vocab_size: rows of the token embedding table (the card's ``vocab_size``).
        max_positions: rows of the position table: the longest input (tokens).
        intermediate_size: MLP width (default ``4 * hidden_size``).
        seed: seed of ``numpy.random.default_rng`` for the weights (same seed → identical weights).
        tokenizer: ``"wordpiece"`` learns a WordPiece vocabulary of at most ``vocab_size`` tokens and
            saves it as ``<name>-<version>.tokenizer.json`` next to the model (``[PAD]`` = 0,
            ``[CLS]``/``[SEP]`` added by its post-processor); ``"byte"`` uses the byte tokenizer.

    Returns:
        Path of the ``.onnx`` file; the card (kind ``encoder``) is next to it with a ``.json`` suffix.

    Raises:
        ValueError: inconsistent sizes, or a vocabulary too small for the chosen tokenizer.
    """
    _check_sizes(num_layers, hidden_size, num_heads, vocab_size, max_positions, tokenizer)
    inter = intermediate_size or 4 * hidden_size
    onnx_path = model_path(out_dir, name, version)
    if tokenizer == "wordpiece":
        tok_file = onnx_path.with_name(f"{name}-{version}.tokenizer.json")
        train_wordpiece(tok_file, vocab_size)
        # [PAD] is id 0; [CLS]/[SEP] come from the tokenizer's post-processor (like BERT: no bos/eos).
        tok_name, pad_id = tok_file.name, SPECIAL_TOKENS.index("[PAD]")
        bos_id: int | None = None
        eos_id: int | None = None
    else:
        tok_name, pad_id = "byte", ByteTokenizer.pad_token_id
        bos_id, eos_id = ByteTokenizer.bos_token_id, ByteTokenizer.eos_token_id

    g = GraphBuilder(name)
    init = WeightInit(g, seed)
    input_ids = g.input("input_ids", TensorProto.INT64, [BATCH, SEQ])
    attention_mask = g.input("attention_mask", TensorProto.INT64, [BATCH, SEQ])
    token_type_ids = g.input("token_type_ids", TensorProto.INT64, [BATCH, SEQ])

    word = init.normal("embeddings.word.weight", (vocab_size, hidden_size), 1.0)
    position = init.normal("embeddings.position.weight", (max_positions, hidden_size), 0.5)
    token_type = init.normal("embeddings.token_type.weight", (TYPE_VOCAB_SIZE, hidden_size), 0.5)
    positions = g.op("Range", [g.i64(0, "zero_i64"), dim(g, input_ids, 1, "seq_len"), g.i64(1, "one_i64")],
                     hint="positions")
    x = g.op("Add", [g.op("Gather", [word, input_ids], hint="word_emb", axis=0),
                     g.op("Gather", [position, positions], hint="pos_emb", axis=0)], hint="emb_sum")
    x = g.op("Add", [x, g.op("Gather", [token_type, token_type_ids], hint="type_emb", axis=0)], hint="emb")
    x = layer_norm(g, x, init.norm("embeddings.ln", hidden_size), "embeddings.ln")
    bias = additive_bias(g, padding_allowed(g, attention_mask))  # [B, 1, 1, S]
    for i in range(num_layers):
        x = _encoder_layer(g, init, x, bias, i, num_heads=num_heads, hidden=hidden_size, intermediate=inter)
    g.op("Identity", [x], outputs=["last_hidden_state"])
    g.output("last_hidden_state", TensorProto.FLOAT, [BATCH, SEQ, hidden_size])

    card = ModelCard(
        name=name, version=version, kind="encoder", vocab_size=vocab_size, max_positions=max_positions,
        num_layers=num_layers, num_heads=num_heads, head_dim=hidden_size // num_heads,
        hidden_size=hidden_size, pad_token_id=pad_id, bos_token_id=bos_id, eos_token_id=eos_id,
        tokenizer=tok_name, parameters=g.parameter_count, seed=seed,
    )
    return write_model(g.build(card_metadata(card)), card, out_dir)
