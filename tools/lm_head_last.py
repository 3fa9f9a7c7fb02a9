"""A model variant that computes the LM head only at each row's last real position.

A next-token request needs one row of logits, but the exported graph projects every position onto
the vocabulary: for a batch of 8 x 256 tokens over 8,192 ids that is 64 MiB of float32 written
and an 8k-wide matrix product per position. This rewrite inserts, right before the final
``MatMul`` that produces ``logits``::

    last   = ReduceSum(attention_mask[:, past_len:], axis=1) - 1                 # [batch]
    hidden = GatherND(hidden, last[:, None], batch_dims=1)[:, None, :]           # [batch, 1, hidden]

so ``logits`` becomes ``[batch, 1, vocab]``: the new tokens of a call are right-padded, so the last
real one of row ``b`` sits at the count of its real new tokens minus one, whatever its past holds
(a left-padded past in a decode step of the continuous-batching loop included). ``present.*``
outputs are untouched. The worker applies this rewrite in memory when it loads a causal LM
(``engine.lm_head_last``, on by default). It is a separate model file
(version suffix ``-last``), never a replacement: a server must read position 0 of the new output,
which ``workers/postprocess.last_positions`` does (it clips the index to the output length).

Run: ``python -m tools.lm_head_last models/demo-lm/demo-lm-1.0.0.onnx`` → ``demo-lm-1.0.0-last.onnx``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from protocol.modelcard import card_path_for, load_card

__all__ = ["main", "rewrite_lm_head_last", "write_last_variant"]


def rewrite_lm_head_last(model: onnx.ModelProto) -> onnx.ModelProto:
    """Return a copy of ``model`` whose ``logits`` are computed at the last real position only.

    Raises:
        ValueError: no ``logits`` output produced by a ``MatMul``, or no ``attention_mask`` input.
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    producers = [n for n in graph.node if "logits" in n.output]
    if len(producers) != 1 or producers[0].op_type != "MatMul":
        raise ValueError("expected 'logits' to be produced by one MatMul (hidden x lm_head)")
    if "attention_mask" not in {i.name for i in graph.input} or "input_ids" not in {i.name for i in graph.input}:
        raise ValueError("the graph needs 'input_ids' and 'attention_mask' inputs")
    head = producers[0]
    hidden = head.input[0]
    p = "lm_head_last/"
    consts = [
        helper.make_tensor(p + "axis1", TensorProto.INT64, [1], [1]),
        helper.make_tensor(p + "one", TensorProto.INT64, [], [1]),
        helper.make_tensor(p + "idx1", TensorProto.INT64, [1], [1]),
    ]
    graph.initializer.extend(consts)
    nodes = [
        helper.make_node("Shape", ["attention_mask"], [p + "mask_shape"]),
        helper.make_node("Gather", [p + "mask_shape", p + "idx1"], [p + "total_len"], axis=0),  # [1]
        helper.make_node("Shape", ["input_ids"], [p + "ids_shape"]),
        helper.make_node("Gather", [p + "ids_shape", p + "idx1"], [p + "seq_len"], axis=0),  # [1]
        helper.make_node("Sub", [p + "total_len", p + "seq_len"], [p + "past_len"]),  # [1]
        helper.make_node("Slice", ["attention_mask", p + "past_len", p + "total_len", p + "axis1"], [p + "new_mask"]),
        helper.make_node("ReduceSum", [p + "new_mask", p + "axis1"], [p + "real_new"], keepdims=0),  # [B]
        helper.make_node("Sub", [p + "real_new", p + "one"], [p + "last"]),  # [B]
        helper.make_node("Unsqueeze", [p + "last", p + "idx1"], [p + "last_col"]),  # [B, 1]
        helper.make_node("GatherND", [hidden, p + "last_col"], [p + "picked"], batch_dims=1),  # [B, H]
        helper.make_node("Unsqueeze", [p + "picked", p + "idx1"], [p + "hidden_last"]),  # [B, 1, H]
    ]
    head.input[0] = p + "hidden_last"
    position = list(graph.node).index(head)
    for offset, node in enumerate(nodes):
        graph.node.insert(position + offset, node)
    for output in graph.output:
        if output.name == "logits":
            dims = output.type.tensor_type.shape.dim
            if len(dims) == 3:
                dims[1].ClearField("dim_param")
                dims[1].dim_value = 1
    onnx.checker.check_model(out)
    return out


def write_last_variant(model_file: Path, suffix: str = "-last") -> Path:
    """Write ``<name>-<version><suffix>.onnx`` and its card next to ``model_file``; returns its path."""
    card = load_card(model_file)
    version = card.version + suffix
    target = model_file.with_name(f"{card.name}-{version}.onnx")
    model = rewrite_lm_head_last(onnx.load(str(model_file)))
    for prop in model.metadata_props:
        if prop.key == "version":
            prop.value = version
    tmp = target.with_suffix(".onnx.tmp")
    onnx.save(model, str(tmp))
    tmp.replace(target)
    card_path_for(target).write_text(card.model_copy(update={"version": version}).model_dump_json(indent=2) + "\n")
    return target


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tools.lm_head_last MODEL.onnx``; prints the new file's path."""
    parser = argparse.ArgumentParser(prog="python -m tools.lm_head_last", description=__doc__.split("\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--suffix", default="-last", help="version suffix of the new file (default -last)")
    args = parser.parse_args(argv)
    try:
        print(write_last_variant(args.model, args.suffix))
    except (ValueError, FileNotFoundError) as exc:
        print(f"lm_head_last: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
