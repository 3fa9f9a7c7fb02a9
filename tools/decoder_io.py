"""What the causal-LM builders share: optimum's ``text-generation-with-past`` I/O and the byte-tokenizer card.

Every causal LM with a KV cache that ``fleet build-model`` writes has these graph inputs and outputs
(``L`` layers, ``kv`` KV heads, ``d`` head dim); their *order* follows the architecture's optimum
export (its ``forward`` signature), which is why the engine binds by name::

    input_ids                   int64   [batch_size, sequence_length]
    attention_mask              int64   [batch_size, past_sequence_length + sequence_length]
    position_ids                int64   [batch_size, sequence_length]
    past_key_values.{i}.key     float32 [batch_size, kv, past_sequence_length, d]    i = 0 … L-1
    past_key_values.{i}.value   float32 [batch_size, kv, past_sequence_length, d]
    ->
    logits                      float32 [batch_size, sequence_length, vocab_size]   (first output)
    present.{i}.key / .value    float32 [batch_size, kv, past_sequence_length + sequence_length, d]

A prefill is a call with empty past tensors ``[batch_size, kv, 0, d]``.
"""

from __future__ import annotations

from pathlib import Path

from onnx import TensorProto

from protocol.modelcard import ModelCard
from protocol.tokenization import ByteTokenizer
from tools.artifacts import card_metadata, write_model
from tools.generation_assets import generation_assets
from tools.onnx_graph import GraphBuilder
from tools.onnx_layers import WeightInit

__all__ = [
    "BATCH",
    "LOGIT_STD",
    "PAST",
    "SEQ",
    "TOTAL",
    "check_decoder_sizes",
    "declare_io",
    "lm_head",
    "present",
    "write_decoder",
]

BATCH, SEQ, PAST = "batch_size", "sequence_length", "past_sequence_length"
TOTAL = f"{PAST} + {SEQ}"
"""Symbolic dimension names, as optimum writes them."""

LOGIT_STD = 4.0
"""Target standard deviation of the logits (units of log-probability): well spread, few near-ties."""


def check_decoder_sizes(*, num_layers: int, hidden_size: int, num_heads: int, vocab_size: int,
                        max_positions: int, num_kv_heads: int | None = None) -> None:
    """Refuse sizes no decoder can have.

    Raises:
        ValueError: vocabulary below the byte tokenizer's 259 ids, a size below 1, heads not dividing
            the hidden size, or KV heads not dividing the attention heads.
    """
    if vocab_size < ByteTokenizer.vocab_size:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: the byte tokenizer needs at least "
            f"{ByteTokenizer.vocab_size} ids (pad, bos, eos + 256 bytes)"
        )
    if min(num_layers, num_heads, max_positions, num_kv_heads or 1) < 1:
        raise ValueError("num_layers, num_heads, num_kv_heads and max_positions must be >= 1")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} is not a multiple of num_heads={num_heads}")
    if num_kv_heads is not None and num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")


def declare_io(g: GraphBuilder, *, num_layers: int, kv_heads: int, head_dim: int, vocab_size: int,
               past_first: bool) -> tuple[str, str, str]:
    """Declare the inputs and the ``logits`` output; return ``(input_ids, attention_mask, position_ids)``.

    ``past_first``: GPT-2's order (``input_ids``, ``past_key_values.*``, ``attention_mask``,
    ``position_ids``: its ``forward`` takes ``past_key_values`` second); otherwise Llama's
    (``input_ids``, ``attention_mask``, ``position_ids``, ``past_key_values.*``). The ``present.*``
    outputs are declared by :func:`present`, after ``logits``.
    """
    input_ids = g.input("input_ids", TensorProto.INT64, [BATCH, SEQ])

    def past() -> None:
        for i in range(num_layers):
            for kind in ("key", "value"):
                g.input(f"past_key_values.{i}.{kind}", TensorProto.FLOAT, [BATCH, kv_heads, PAST, head_dim])

    if past_first:
        past()
    attention_mask = g.input("attention_mask", TensorProto.INT64, [BATCH, TOTAL])
    position_ids = g.input("position_ids", TensorProto.INT64, [BATCH, SEQ])
    if not past_first:
        past()
    g.output("logits", TensorProto.FLOAT, [BATCH, SEQ, vocab_size])
    return input_ids, attention_mask, position_ids


def present(g: GraphBuilder, i: int, kind: str, new: str, kv_heads: int, head_dim: int) -> str:
    """Output ``present.{i}.{kind}`` = the past of layer ``i`` followed by ``new`` (axis 2); its name."""
    name = f"present.{i}.{kind}"
    g.op("Concat", [f"past_key_values.{i}.{kind}", new], outputs=[name], axis=2)
    g.output(name, TensorProto.FLOAT, [BATCH, kv_heads, TOTAL, head_dim])
    return name


def lm_head(g: GraphBuilder, init: WeightInit, x: str, hidden_size: int, vocab_size: int) -> None:
    """``logits = x @ lm_head.weight`` (one MatMul, so ``tools.lm_head_last`` can rewrite it)."""
    weight = init.normal("lm_head.weight", (hidden_size, vocab_size), LOGIT_STD / hidden_size**0.5)
    g.op("MatMul", [x, weight], outputs=["logits"])


def write_decoder(g: GraphBuilder, out_dir: Path, *, eos_token_id: int | list[int], **card_fields: object) -> Path:
    """Write the graph, its card (byte tokenizer: pad 0 / bos 1 / eos 2) and the generation assets.

    ``card_fields`` are the :class:`~protocol.modelcard.ModelCard` fields that differ per model (name,
    version, sizes, seed); ``eos_token_id`` goes to ``generation_config.json`` as written (an id or a
    list). Returns the ``.onnx`` path.
    """
    card = ModelCard.model_validate({
        "kind": "causal_lm", "pad_token_id": ByteTokenizer.pad_token_id,
        "bos_token_id": ByteTokenizer.bos_token_id, "eos_token_id": ByteTokenizer.eos_token_id,
        "tokenizer": "byte", "parameters": g.parameter_count, **card_fields,
    })
    # the folder's generation assets are published before the model: a reader that finds it finds them
    return write_model(g.build(card_metadata(card)), card, out_dir,
                       sidecars=generation_assets(card, eos_token_id=eos_token_id))
