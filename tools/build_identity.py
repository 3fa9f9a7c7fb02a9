"""A zero-cost causal-LM-shaped model, to measure what the queue itself costs per request.

Graph inputs and output (no ``past_key_values``, no ``present``)::

    input_ids       int64   [batch_size, sequence_length]
    attention_mask  int64   [batch_size, sequence_length]    accepted, unused
    position_ids    int64   [batch_size, sequence_length]    accepted, unused
    logits          float32 [batch_size, sequence_length, vocab_size]

``logits[b, s]`` is the one-hot vector of ``input_ids[b, s]`` (one ``OneHot`` node, no weights), so
its top-1 is the input token itself: deterministic, and as cheap as writing the output.
"""

from __future__ import annotations

from pathlib import Path

from onnx import TensorProto

from protocol.modelcard import ModelCard
from protocol.tokenization import ByteTokenizer
from tools.artifacts import card_metadata, write_model
from tools.onnx_graph import GraphBuilder

__all__ = ["build_identity"]

BATCH, SEQ = "batch_size", "sequence_length"


def build_identity(out_dir: Path, name: str = "identity", version: str = "1.0.0", vocab_size: int = 512,
                   max_positions: int = 4096) -> Path:
    """Write the identity model ``<out_dir>/<name>/<name>-<version>.onnx`` and its card.

    Args:
        out_dir: root folder of the model store.
        vocab_size: logits per position (>= 259 for the byte tokenizer).
        max_positions: longest input the card admits (tokens); the graph itself has no limit.

    Returns:
        Path of the ``.onnx`` file; the card (kind ``causal_lm``, ``num_layers`` 0, byte tokenizer)
        is next to it with a ``.json`` suffix.

    Raises:
        ValueError: ``vocab_size`` is too small for the byte tokenizer.
    """
    if vocab_size < ByteTokenizer.vocab_size:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: the byte tokenizer needs at least "
            f"{ByteTokenizer.vocab_size} ids (pad, bos, eos + 256 bytes)"
        )
    g = GraphBuilder(name)
    input_ids = g.input("input_ids", TensorProto.INT64, [BATCH, SEQ])
    g.input("attention_mask", TensorProto.INT64, [BATCH, SEQ])
    g.input("position_ids", TensorProto.INT64, [BATCH, SEQ])
    g.op("OneHot", [input_ids, g.i64([vocab_size], "depth"), g.f32([0.0, 1.0], "off_on")],
         outputs=["logits"], axis=-1)
    g.output("logits", TensorProto.FLOAT, [BATCH, SEQ, vocab_size])
    card = ModelCard(
        name=name, version=version, kind="causal_lm", vocab_size=vocab_size, max_positions=max_positions,
        num_layers=0, num_heads=1, head_dim=1, hidden_size=1, pad_token_id=ByteTokenizer.pad_token_id,
        bos_token_id=ByteTokenizer.bos_token_id, eos_token_id=ByteTokenizer.eos_token_id,
        tokenizer="byte", parameters=0, seed=None,
    )
    return write_model(g.build(card_metadata(card)), card, out_dir)
