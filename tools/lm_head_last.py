"""A model variant that computes the LM head only at each row's last real position.

A next-token request needs one row of logits, but the exported graph projects every position onto
the vocabulary: for a batch of 8 x 256 tokens over 8,192 ids that is 64 MiB of float32 written
and an 8k-wide matrix product per position. This rewrite inserts, right before the LM head (the
``MatMul`` behind ``logits``, or its INT8 form: see :func:`rewrite_lm_head_last`)::

    last   = ReduceSum(attention_mask[:, past_len:], axis=1) - 1                 # [batch]
    hidden = GatherND(hidden, last[:, None], batch_dims=1)[:, None, :]           # [batch, 1, hidden]

so ``logits`` becomes ``[batch, 1, vocab]``: the new tokens of a call are right-padded, so the last
real one of row ``b`` sits at the count of its real new tokens minus one, whatever its past holds
(a left-padded past in a decode step of the continuous-batching loop included). ``present.*``
outputs are untouched. INT8 graphs as ``fleet quantize`` writes them are rewritten too, with
logits equal to the full INT8 graph's at each last position: dynamic (``DynamicQuantizeLinear`` →
``MatMulInteger`` → ``Cast`` → ``Mul``; the gather takes the ``uint8`` values, since the dynamic scale
spans the whole tensor), ONNX Runtime's fused ``DynamicQuantizeMatMul`` (split first), and static
QDQ (the gather goes before the per-tensor ``QuantizeLinear``, so the ``Q → DQ → MatMul → Q → DQ``
pattern that ONNX Runtime and TensorRT run as INT8 stays whole). The worker applies this rewrite
in memory when it loads a causal LM (``engine.lm_head_last``, on by default). It is a separate
model file (version suffix ``-last``), never a replacement: a server must read position 0 of the new output,
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

from protocol.modelcard import load_card
from tools.artifacts import publish_model

__all__ = ["main", "rewrite_lm_head_last", "write_last_variant"]


HEAD_OPS = frozenset({"MatMul", "MatMulInteger", "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "QLinearMatMul"})
"""Ops that can be the LM head (``hidden x lm_head``): float, and as ONNX Runtime's quantizer and
optimizer write it (dynamic INT8: ``MatMulInteger``, fused ``DynamicQuantizeMatMul``; static QDQ:
``MatMul`` between ``DequantizeLinear`` and ``QuantizeLinear``)."""

_TAIL_OPS = frozenset({"Cast", "Mul", "Add", "QuantizeLinear", "DequantizeLinear"})
"""Elementwise ops allowed between the head and ``logits`` (dynamic INT8 rescales the integer
product with ``Cast`` + ``Mul``; static QDQ re-quantizes the logits with ``QuantizeLinear`` +
``DequantizeLinear``): a ``[batch, 1, vocab]`` product flows through them unchanged."""

_PER_TENSOR_QDQ = frozenset({"QuantizeLinear", "DequantizeLinear"})


def _consumers(graph: onnx.GraphProto, name: str) -> list[onnx.NodeProto]:
    return [n for n in graph.node if name in n.input]


def _find_head(graph: onnx.GraphProto, producers: dict[str, onnx.NodeProto]) -> onnx.NodeProto:
    """The head node that ``logits`` comes from, through at most 4 elementwise tail ops.

    Raises:
        ValueError: no head op found, or a tail value is used by more than the chain.
    """
    outputs = {o.name for o in graph.output}

    def walk(name: str, depth: int) -> onnx.NodeProto | None:
        node = producers.get(name)
        if node is None:
            return None
        if node.op_type in HEAD_OPS:
            return node
        if depth == 0 or node.op_type not in _TAIL_OPS:
            return None
        candidates = node.input[:2] if node.op_type in ("Mul", "Add") else node.input[:1]
        found = [h for h in (walk(i, depth - 1) for i in candidates if i) if h is not None]
        return found[0] if len(found) == 1 else None

    head = walk("logits", 4)
    if head is None:
        raise ValueError(
            "expected 'logits' to come from one head op (" + "/".join(sorted(HEAD_OPS)) + ") through "
            "elementwise ops (" + "/".join(sorted(_TAIL_OPS)) + ")"
        )
    name = head.output[0]
    while name != "logits":  # every value between head and logits feeds the next step only
        users = _consumers(graph, name)
        if len(users) != 1 or name in outputs:
            raise ValueError(f"'{name}' between the LM head and 'logits' is used elsewhere")
        name = users[0].output[0]
    return head


def _is_scalar(graph: onnx.GraphProto, name: str) -> bool:
    """``name`` is an initializer with one element (a per-tensor scale)."""
    for init in graph.initializer:
        if init.name == name:
            return len(init.dims) == 0 or list(init.dims) == [1]
    return False


def _gather_point(
    graph: onnx.GraphProto, producers: dict[str, onnx.NodeProto], head: onnx.NodeProto
) -> tuple[onnx.NodeProto, int]:
    """The node and input slot where the hidden states are gathered: the head's activation input,
    moved up through per-tensor ``DequantizeLinear``/``QuantizeLinear`` that feed only it.

    Per-tensor (de)quantization is elementwise, so gathering before it gives the same values; in a
    static QDQ graph the head keeps its ``QuantizeLinear → DequantizeLinear → MatMul`` pattern,
    which ONNX Runtime fuses into an INT8 ``QLinearMatMul`` and TensorRT reads as an INT8 layer.
    Not through ``DynamicQuantizeLinear``: its scale spans the whole tensor, so the gather goes after
    it, on the ``uint8`` values, and ``MatMulInteger`` gives exactly the full graph's rows.
    """
    node, slot = head, 0
    while True:
        producer = producers.get(node.input[slot])
        if (
            producer is None
            or producer.op_type not in _PER_TENSOR_QDQ
            or len(_consumers(graph, node.input[slot])) != 1
            or not _is_scalar(graph, producer.input[1])
        ):
            return node, slot
        node, slot = producer, 0


def _drop_stale_shapes(graph: onnx.GraphProto, start: onnx.NodeProto) -> None:
    """Remove the ``value_info`` of every value computed from ``start`` on: a quantized graph carries
    the shapes inferred for the full graph (``[batch, seq, ...]``), which no longer hold."""
    stale: set[str] = set()
    frontier = [start]
    while frontier:
        node = frontier.pop()
        fresh = [o for o in node.output if o and o not in stale]
        stale.update(fresh)
        frontier.extend(c for name in fresh for c in _consumers(graph, name))
    kept = [v for v in graph.value_info if v.name not in stale]
    del graph.value_info[:]
    graph.value_info.extend(kept)


def _split_dynamic_quantize_matmul(graph: onnx.GraphProto, head: onnx.NodeProto) -> onnx.NodeProto:
    """Replace a fused ``DynamicQuantizeMatMul`` head by ``DynamicQuantizeLinear`` (over the whole
    input, as the fused op quantizes it) and ``MatMulIntegerToFloat``; returns the new head.

    Gathering the fused op's float input would compute the activation scale over the last rows only,
    and the rows would differ from the full graph's by INT8 rounding (up to 0.75 of logits up to 13
    on demo-lm); after the split the gather takes the ``uint8`` values, as for ``MatMulInteger``.
    """
    a, b, b_scale, b_zero = head.input[0], head.input[1], head.input[2], head.input[3]
    bias = head.input[4] if len(head.input) > 4 else ""
    p = "lm_head_last/"
    quantize = helper.make_node("DynamicQuantizeLinear", [a], [p + "a_q", p + "a_scale", p + "a_zero"])
    inputs = [p + "a_q", b, p + "a_scale", b_scale, p + "a_zero", b_zero] + ([bias] if bias else [])
    matmul = helper.make_node("MatMulIntegerToFloat", inputs, list(head.output), domain="com.microsoft")
    position = list(graph.node).index(head)
    graph.node.remove(head)
    graph.node.insert(position, matmul)
    graph.node.insert(position, quantize)
    inserted: onnx.NodeProto = graph.node[position + 1]  # protobuf copies on insert
    return inserted


def rewrite_lm_head_last(model: onnx.ModelProto) -> onnx.ModelProto:
    """Return a copy of ``model`` whose ``logits`` are computed at the last real position only.

    The head may be float (``MatMul``) or INT8 as ONNX Runtime writes it (:data:`HEAD_OPS`), with
    elementwise ops between it and ``logits``; the gather goes where the rows it keeps are computed
    exactly as in the full graph (:func:`_gather_point`), so each row of the new ``logits`` equals the
    full graph's row at that position.

    Raises:
        ValueError: no head op behind ``logits``, a value of the chain used elsewhere, or no
            ``input_ids``/``attention_mask`` input.
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    if "attention_mask" not in {i.name for i in graph.input} or "input_ids" not in {i.name for i in graph.input}:
        raise ValueError("the graph needs 'input_ids' and 'attention_mask' inputs")
    producers = {o: n for n in graph.node for o in n.output}
    head = _find_head(graph, producers)
    if head.op_type == "DynamicQuantizeMatMul":
        head = _split_dynamic_quantize_matmul(graph, head)
        producers = {o: n for n in graph.node for o in n.output}
    target, slot = _gather_point(graph, producers, head)
    hidden = target.input[slot]
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
    target.input[slot] = p + "hidden_last"
    position = list(graph.node).index(target)
    for offset, node in enumerate(nodes):
        graph.node.insert(position + offset, node)
    for output in graph.output:
        if output.name == "logits":
            dims = output.type.tensor_type.shape.dim
            if len(dims) == 3:
                dims[1].ClearField("dim_param")
                dims[1].dim_value = 1
    _drop_stale_shapes(graph, target)
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
    return publish_model(target, model.SerializeToString(), card.model_copy(update={"version": version}))


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
