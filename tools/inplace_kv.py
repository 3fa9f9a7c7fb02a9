"""Rewrite a causal LM's attention so its KV cache is written in place (ONNX Runtime's GroupQueryAttention).

An exported decoder (optimum's ``text-generation-with-past``, the fleet's own builders) grows its cache
with ``present = Concat(past, new)``: every step copies the whole past of every row into a new
tensor, and rows of different lengths must be re-laid out whenever one joins or leaves. This rewrite
replaces, in each layer, the two ``Concat`` nodes and the attention that reads them (the score
``MatMul``, the mask, ``Softmax`` and the ``MatMul`` with the values) by one ``com.microsoft``
``GroupQueryAttention`` node. With ``past_key_values.*`` and ``present.*`` bound to the same buffer
``[slots, kv_heads, capacity, head_dim]``, that node writes each row's new keys and values at the
row's own position and reads only its ``seqlens_k + 1`` first columns: nothing else is copied.

What the rewritten graph takes (the fleet's slot protocol, :mod:`workers.generation.slots`):

- ``attention_mask`` ``[rows, T]``: row ``b`` holds ``total_b`` ones (its past plus its new tokens);
  only the row sums and the width matter (``seqlens_k = sum - 1``, ``total_sequence_length = T``).
- ``position_ids``: each new token's column in its row (the count of tokens before it).
- A call is either a *first prompt* (every row starts at column 0, new tokens right-padded, ``T`` = the
  padded width) or rows that all add the same number of tokens after their past (a decode step: one
  each; a prompt continued after a cached prefix or an earlier chunk: one row per call).

The match is structural, layer by layer, from each ``present.{i}.key/.value`` back to its ``Concat``
and forward to the attention: the keys may pass through ``Unsqueeze``/``Expand``/``Reshape`` (grouped
heads), one ``Transpose`` and scalar ``Mul``/``Div`` to the score ``MatMul``; the values through the
grouping ops to the output ``MatMul``. Every scale on the way (constants or computed, as optimum's
``sqrt(1/sqrt(d))`` on both sides) multiplies the query, and the node's own ``scale`` is 1. A graph
that does not match raises :class:`ValueError` naming the layer and the op; a graph that already holds
``GroupQueryAttention`` nodes on its past inputs is returned as it is. The worker checks the result
against the original graph on a probe before serving it (:func:`workers.generation.inplace_check`).

Run: ``python -m tools.inplace_kv MODEL.onnx`` → ``<name>-<version>-inplace.onnx`` and its card (the worker
does it in memory at load; a worker serving the written file takes it as it is and runs its probe too).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import onnx
from onnx import TensorProto, helper

__all__ = ["GQA_OP", "has_inplace_attention", "main", "rewrite_inplace_kv"]

GQA_OP = "GroupQueryAttention"
PAST = "past_key_values."
PRESENT = "present."
_GROUPING_OPS = frozenset({"Unsqueeze", "Expand", "Reshape"})
"""Ops that repeat KV heads for grouped queries (Hugging Face's ``repeat_kv``): GroupQueryAttention
groups heads itself (query head ``h`` reads KV head ``h // (num_heads / kv_heads)``)."""
_SCALE_OPS = frozenset({"Mul", "Div"})
_SCORE_OPS = frozenset({"Add", "Where", "Cast", "Mul", "Div"})
"""Between the score ``MatMul`` and ``Softmax``: the additive mask, masked fill, scales."""
_PROB_OPS = frozenset({"Where", "Cast", "Dropout", "Identity"})
"""Between ``Softmax`` and the output ``MatMul`` (a NaN guard on fully masked rows, a cast)."""
_GUARD_OPS = frozenset({"IsNaN", "IsInf"})
"""Predicates of a guard (``Where(IsNaN(p), 0, p)``): they read the probabilities beside the path."""


@dataclass
class _Graph:
    """Producer and consumer maps of a graph (rebuilt after each layer's edit)."""

    graph: onnx.GraphProto
    producer: dict[str, onnx.NodeProto] = field(init=False)
    consumers: dict[str, list[onnx.NodeProto]] = field(init=False)

    def __post_init__(self) -> None:
        self.producer = {o: n for n in self.graph.node for o in n.output}
        self.consumers = {}
        for node in self.graph.node:
            for name in node.input:
                self.consumers.setdefault(name, []).append(node)

    def data_consumers(self, name: str) -> list[onnx.NodeProto]:
        """Consumers of ``name`` other than ``Shape`` (shape arithmetic dies with the old attention)."""
        return [n for n in self.consumers.get(name, []) if n.op_type != "Shape"]


@dataclass
class _Layer:
    """What one layer's attention is made of, as found in the graph."""

    index: int
    query: str
    """The query ``[B, heads, S, d]`` as it enters the score ``MatMul``."""
    new_key: str
    new_value: str
    """``[B, kv_heads, S, d]``: the second inputs of the two ``Concat`` nodes."""
    scales: list[tuple[str, str]]
    """(``Mul``/``Div``, scalar tensor) applied to keys or scores: the query gets them instead."""
    output: str
    """The output ``MatMul``'s result ``[B, heads, S, d]``."""
    removed: list[onnx.NodeProto]
    """The two ``Concat`` nodes (the rest of the old attention is left unused and pruned)."""


def has_inplace_attention(model: onnx.ModelProto) -> bool:
    """True when the graph's ``past_key_values.*`` inputs already feed ``GroupQueryAttention`` nodes."""
    pasts = {i.name for i in model.graph.input if i.name.startswith(PAST)}
    return any(n.op_type == GQA_OP and pasts & set(n.input) for n in model.graph.node)


def _other(node: onnx.NodeProto, name: str) -> str:
    """The other input of a binary node that takes ``name``."""
    return str(node.input[1] if node.input[0] == name else node.input[0])


def _walk_keys(g: _Graph, start: str, layer: int) -> tuple[onnx.NodeProto, list[tuple[str, str]]]:
    """From the key ``Concat`` output to the score ``MatMul`` (its second input); returns it and the scales."""
    name, transposes = start, 0
    scales: list[tuple[str, str]] = []
    for _ in range(16):
        nexts = g.data_consumers(name)
        if len(nexts) != 1:
            raise ValueError(f"layer {layer}: keys {name!r} feed {[n.op_type for n in nexts]}, not one attention")
        node = nexts[0]
        if node.op_type == "MatMul":
            if node.input[1] != name or transposes != 1:
                raise ValueError(f"layer {layer}: the key MatMul {node.name!r} does not take transposed keys second")
            return node, scales
        if node.op_type in _GROUPING_OPS and node.input[0] == name:
            pass
        elif node.op_type == "Transpose":
            perm = next((list(helper.get_attribute_value(a)) for a in node.attribute if a.name == "perm"), [])
            if perm != [0, 1, 3, 2]:
                raise ValueError(f"layer {layer}: key Transpose {node.name!r} has perm {perm}")
            transposes += 1
        elif node.op_type in _SCALE_OPS and (node.op_type == "Mul" or node.input[0] == name):
            scales.append((node.op_type, _other(node, name)))
        else:
            raise ValueError(f"layer {layer}: unexpected {node.op_type} {node.name!r} on the keys")
        name = node.output[0]
    raise ValueError(f"layer {layer}: no score MatMul within 16 ops of the keys")


def _walk_values(g: _Graph, start: str, layer: int) -> onnx.NodeProto:
    """From the value ``Concat`` output to the output ``MatMul`` (its second input)."""
    name = start
    for _ in range(8):
        nexts = g.data_consumers(name)
        if len(nexts) != 1:
            raise ValueError(f"layer {layer}: values {name!r} feed {[n.op_type for n in nexts]}, not one attention")
        node = nexts[0]
        if node.op_type == "MatMul" and node.input[1] == name:
            return node
        if node.op_type not in _GROUPING_OPS or node.input[0] != name:
            raise ValueError(f"layer {layer}: unexpected {node.op_type} {node.name!r} on the values")
        name = node.output[0]
    raise ValueError(f"layer {layer}: no value MatMul within 8 ops of the values")


def _walk_scores(g: _Graph, scores: onnx.NodeProto, output: onnx.NodeProto, layer: int) -> list[tuple[str, str]]:
    """Checks scores → (mask, scales) → ``Softmax`` → ``output``'s first input; returns the scales."""
    name, seen_softmax = scores.output[0], False
    scales: list[tuple[str, str]] = []
    for _ in range(16):
        if name == output.input[0]:
            if not seen_softmax:
                raise ValueError(f"layer {layer}: no Softmax between the score and output MatMuls")
            return scales
        nexts = [n for n in g.data_consumers(name) if n.op_type not in _GUARD_OPS]
        if len(nexts) != 1:
            raise ValueError(f"layer {layer}: scores {name!r} feed {[n.op_type for n in nexts]}")
        node = nexts[0]
        if node.op_type == "Softmax":
            axis = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), -1)
            if axis not in (-1, 3) or seen_softmax:
                raise ValueError(f"layer {layer}: Softmax {node.name!r} over axis {axis}")
            seen_softmax = True
        elif node.op_type in _SCALE_OPS and not seen_softmax and (node.op_type == "Mul" or node.input[0] == name):
            scales.append((node.op_type, _other(node, name)))
        elif node.op_type not in (_PROB_OPS if seen_softmax else _SCORE_OPS):
            raise ValueError(f"layer {layer}: unexpected {node.op_type} {node.name!r} in the attention scores")
        name = node.output[0]
    raise ValueError(f"layer {layer}: the attention scores do not reach the output MatMul within 16 ops")


def _find_layer(g: _Graph, index: int) -> _Layer:
    concats = []
    for kind in ("key", "value"):
        node = g.producer.get(f"{PRESENT}{index}.{kind}")
        past = f"{PAST}{index}.{kind}"
        if node is None or node.op_type != "Concat" or list(node.input[:1]) != [past] or len(node.input) != 2:
            found = "nothing" if node is None else f"{node.op_type}{list(node.input)}"
            raise ValueError(f"layer {index}: present.{index}.{kind} is not Concat({past}, new) but {found}")
        axis = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), None)
        if axis not in (2, -2):
            raise ValueError(f"layer {index}: the {kind} Concat joins axis {axis}, not the sequence axis 2")
        concats.append(node)
    key_concat, value_concat = concats
    scores, key_scales = _walk_keys(g, key_concat.output[0], index)
    output = _walk_values(g, value_concat.output[0], index)
    score_scales = _walk_scores(g, scores, output, index)
    return _Layer(index, scores.input[0], key_concat.input[1], value_concat.input[1], key_scales + score_scales,
                  output.output[0], concats)


def _prune(graph: onnx.GraphProto) -> None:
    """Drop nodes (and initializers) nothing reaches the graph outputs through."""
    needed = {o.name for o in graph.output}
    kept: list[onnx.NodeProto] = []
    for node in reversed(graph.node):
        if any(o in needed for o in node.output):
            kept.append(node)
            needed.update(i for i in node.input if i)
    del graph.node[:]
    graph.node.extend(reversed(kept))
    used = [t for t in graph.initializer if t.name in needed]
    del graph.initializer[:]
    graph.initializer.extend(used)


def rewrite_inplace_kv(model: onnx.ModelProto, *, num_heads: int, kv_heads: int, head_dim: int) -> onnx.ModelProto:
    """A copy of ``model`` whose every layer's attention is one ``GroupQueryAttention`` (see the module doc).

    Args:
        num_heads / kv_heads / head_dim: the model card's attention sizes.

    Raises:
        ValueError: the graph has no ``attention_mask`` input, or a layer does not match (the message
            names the layer and the op found).
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    if has_inplace_attention(out):
        return out
    graph = out.graph
    inputs = {i.name for i in graph.input}
    if "attention_mask" not in inputs:
        raise ValueError("the graph has no attention_mask input (GroupQueryAttention reads the row lengths from it)")
    layers = sorted({int(n[len(PAST):].split(".")[0]) for n in inputs if n.startswith(PAST)})
    if not layers:
        raise ValueError("the graph has no past_key_values inputs")
    p = "inplace_kv/"
    graph.initializer.extend([
        helper.make_tensor(p + "axis1", TensorProto.INT64, [1], [1]),
        helper.make_tensor(p + "one", TensorProto.INT64, [], [1]),
        helper.make_tensor(p + "bsd", TensorProto.INT64, [3], [0, 0, -1]),
        helper.make_tensor(p + "bsnd", TensorProto.INT64, [4], [0, 0, num_heads, head_dim]),
    ])
    graph.node.extend([
        helper.make_node("ReduceSum", ["attention_mask", p + "axis1"], [p + "mask_sum"], keepdims=0),
        helper.make_node("Sub", [p + "mask_sum", p + "one"], [p + "seqlens_k64"]),
        helper.make_node("Cast", [p + "seqlens_k64"], [p + "seqlens_k"], to=TensorProto.INT32),
        helper.make_node("Shape", ["attention_mask"], [p + "mask_width"], start=1, end=2),
        helper.make_node("Squeeze", [p + "mask_width"], [p + "total64"]),
        helper.make_node("Cast", [p + "total64"], [p + "total"], to=TensorProto.INT32),
    ])
    for index in layers:
        g = _Graph(graph)
        layer = _find_layer(g, index)
        for node in layer.removed:
            graph.node.remove(node)
        q = f"{p}{index}/"
        query = layer.query
        nodes = []
        for n, (op, scalar) in enumerate(layer.scales):
            nodes.append(helper.make_node(op, [query, scalar], [f"{q}query_scaled{n}"]))
            query = f"{q}query_scaled{n}"
        flat = {}
        for role, tensor in (("query", query), ("key", layer.new_key), ("value", layer.new_value)):
            nodes.append(helper.make_node("Transpose", [tensor], [f"{q}{role}_bsnd"], perm=[0, 2, 1, 3]))
            nodes.append(helper.make_node("Reshape", [f"{q}{role}_bsnd", p + "bsd"], [f"{q}{role}_bsd"]))
            flat[role] = f"{q}{role}_bsd"
        nodes.append(helper.make_node(
            GQA_OP,
            [flat["query"], flat["key"], flat["value"], f"{PAST}{index}.key", f"{PAST}{index}.value",
             p + "seqlens_k", p + "total"],
            [f"{q}attn_bsd", f"{PRESENT}{index}.key", f"{PRESENT}{index}.value"],
            domain="com.microsoft", name=f"{q}GroupQueryAttention",
            num_heads=num_heads, kv_num_heads=kv_heads, scale=1.0,
        ))
        nodes.append(helper.make_node("Reshape", [f"{q}attn_bsd", p + "bsnd"], [f"{q}attn_bsnd"]))
        # the old output MatMul's result name, so the rest of the layer reads GroupQueryAttention's
        old = g.producer[layer.output]
        graph.node.remove(old)
        nodes.append(helper.make_node("Transpose", [f"{q}attn_bsnd"], [layer.output], perm=[0, 2, 1, 3]))
        graph.node.extend(nodes)
    _sort(graph)
    _prune(graph)
    if not any(o.domain == "com.microsoft" for o in out.opset_import):
        out.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    del graph.value_info[:]  # shapes of the removed attention (the cache now keeps its capacity)
    for value in [*graph.input, *graph.output]:
        if value.name.startswith((PAST, PRESENT)):
            value.type.tensor_type.shape.dim[2].ClearField("dim_value")
            value.type.tensor_type.shape.dim[2].dim_param = "kv_capacity"
    onnx.checker.check_model(out)
    return out


def _sort(graph: onnx.GraphProto) -> None:
    """Topological order, stable where it can be (the new nodes were appended after their consumers)."""
    available = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    nodes = list(graph.node)
    waiting_on: dict[str, list[int]] = {}
    missing = [0] * len(nodes)
    for index, node in enumerate(nodes):
        for name in set(node.input):
            if name not in available:
                missing[index] += 1
                waiting_on.setdefault(name, []).append(index)
    ready = [i for i, count in enumerate(missing) if count == 0]
    ordered: list[onnx.NodeProto] = []
    while ready:
        index = ready.pop()
        ordered.append(nodes[index])
        for name in nodes[index].output:
            for waiter in waiting_on.pop(name, []):
                missing[waiter] -= 1
                if missing[waiter] == 0:
                    ready.append(waiter)
    if len(ordered) != len(nodes):
        stuck = next(n for i, n in enumerate(nodes) if missing[i])
        raise ValueError(f"the rewritten graph has a cycle or a missing input near {stuck.name!r}")
    del graph.node[:]
    graph.node.extend(ordered)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: write ``<name>-<version>-inplace.onnx`` and its card next to the model (sizes from its card)."""
    from protocol.modelcard import card_path_for, load_card

    parser = argparse.ArgumentParser(prog="python -m tools.inplace_kv", description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    args = parser.parse_args(argv)
    card = load_card(args.model)
    try:
        rewritten = rewrite_inplace_kv(onnx.load(str(args.model)), num_heads=card.num_heads, kv_heads=card.kv_heads,
                                       head_dim=card.head_dim)
    except ValueError as exc:
        print(f"{args.model}: {exc}", file=sys.stderr)
        return 2
    version = f"{card.version}-inplace"
    for prop in rewritten.metadata_props:
        if prop.key == "version":
            prop.value = version
    target = args.model.with_name(f"{card.name}-{version}.onnx")
    onnx.save(rewritten, str(target))
    card_path_for(target).write_text(card.model_copy(update={"version": version}).model_dump_json(indent=2) + "\n")
    print(target)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
