"""Whether an ONNX graph is a model at all, and one its card describes (pure: a proto and a card in).

``push`` checks this before anything is uploaded, because a published version never changes: a
zero-byte or truncated file (protobuf reads either as an empty model), or a card that says
something the graph contradicts, would otherwise stay in the store for good, listed with the card's
kind and limits, and be refused by every worker only at load, or worse, served (a card whose
``vocab_size`` is larger than the graph's logits lets producers send ids the graph cannot embed).

What is compared, only where the graph states it (a static dimension, an input or output the
workers use), so graphs the fleet does not drive by name are not judged:

* the graph has at least one node and one output;
* the output the workers read is there for the card's ``kind`` when the graph has the other kind's
  instead (``logits`` for a ``causal_lm``, ``last_hidden_state`` for an ``encoder``);
* ``logits``' last dimension is the card's ``vocab_size``; ``last_hidden_state``'s is its ``hidden_size``;
* a causal LM's ``past_key_values.{i}.key/.value`` inputs: as many layers as ``num_layers``, each
  ``[batch, kv_heads, past, head_dim]`` with the card's ``kv_heads`` and ``head_dim``;
* ``max_positions`` no larger than the rows of a table the graph looks positions up in: a learned
  position embedding (GPT-2's ``wpe``, BERT's position table: an initializer that a ``Gather`` reads at
  indices computed from ``position_ids``, from an initializer named so, from a ``Range`` or a
  ``CumSum``), or a rotary cos/sin cache (such a ``Gather``, or ``GroupQueryAttention``'s ``cos_cache``
  input). Workers size each KV slot by the card's ``max_positions``, so a card claiming more than the
  table holds reserves memory for positions the graph cannot embed. Rotary embeddings computed from
  ``position_ids`` (the demo llama) have no table and bound nothing.

A causal LM's ``hidden_size`` is not compared with its token embedding's width: they differ in real models
(OPT-350m embeds in 512 and projects to 1024), and its KV layout, which workers size caches by, is checked above.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from protocol.modelcard import ModelCard

if TYPE_CHECKING:  # onnx costs ~0.8 s of CPU to import: only where a graph is read
    import onnx

__all__ = ["GraphMismatch", "graph_mismatches"]

_OUTPUT = {"causal_lm": "logits", "encoder": "last_hidden_state"}
_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
_POSITION_OPS = frozenset({"Range", "CumSum"})
"""Ops that make position indices inside a graph (BERT's ``0 .. S-1``, OPT's count of the mask's ones)."""
_DATA_OPS = frozenset({"Cast", "Identity", "DequantizeLinear", "Slice"})
"""Between a table and the ``Gather`` reading it: float16 casts, INT8 dequantization, ``cos_cached[:S]``."""
_DATA_DEPTH = 8
_GQA = "GroupQueryAttention"
_COS_CACHE = 7
"""``GroupQueryAttention``'s ``cos_cache`` input ``[max positions, rotary_dim / 2]``."""


@dataclass(frozen=True)
class GraphMismatch:
    """One thing the graph says otherwise than the card (``field`` is the card's field)."""

    field: str
    card_value: int | str
    graph_value: int | str
    bound: str = ""
    """Where the graph's value is an upper bound (``max_positions``): what bounds it, e.g. ``the rows of wpe``."""

    def describe(self) -> str:
        """``vocab_size 1024 (the graph's: 512)``; ``max_positions 100000 (the graph's: at most 512, the
        rows of wpe)``."""
        if self.bound:
            return f"{self.field} {self.card_value} (the graph's: at most {self.graph_value}, {self.bound})"
        return f"{self.field} {self.card_value} (the graph's: {self.graph_value})"


def _dims(value: onnx.ValueInfoProto) -> list[int | None]:
    """The static size of each dimension, None where it is symbolic or unknown."""
    shape = value.type.tensor_type.shape
    return [d.dim_value if d.HasField("dim_value") else None for d in shape.dim]


def _last_dim(value: onnx.ValueInfoProto) -> int | None:
    dims = _dims(value)
    return dims[-1] if dims else None


def graph_mismatches(proto: onnx.ModelProto, card: ModelCard) -> list[GraphMismatch]:
    """Where ``proto``'s graph contradicts ``card`` (see the module docstring); [] = consistent.

    An empty graph is reported alone (field ``graph``), as is a graph of the other kind (field ``kind``).
    """
    graph = proto.graph
    if not graph.node or not graph.output:
        return [GraphMismatch("graph", "a model", f"{len(graph.node)} nodes, {len(graph.output)} outputs")]
    outputs = {o.name: o for o in graph.output}
    wanted = _OUTPUT[card.kind]
    other = next(kind for kind in _OUTPUT if kind != card.kind)
    if wanted not in outputs and _OUTPUT[other] in outputs:
        return [GraphMismatch("kind", card.kind, f"{other} (outputs {_OUTPUT[other]}, not {wanted})")]
    found: list[GraphMismatch] = []
    size = _last_dim(outputs[wanted]) if wanted in outputs else None
    expected = card.vocab_size if card.kind == "causal_lm" else card.hidden_size
    if size is not None and size != expected:
        found.append(GraphMismatch("vocab_size" if card.kind == "causal_lm" else "hidden_size", expected, size))
    tables = _Tables(graph)
    if card.kind == "causal_lm":
        found += _kv_mismatches(graph, card)
    bound = tables.position_bound()
    if bound is not None and card.max_positions > bound[0]:
        found.append(GraphMismatch("max_positions", card.max_positions, bound[0], bound=bound[1]))
    return found


def _kv_mismatches(graph: onnx.GraphProto, card: ModelCard) -> list[GraphMismatch]:
    past = [(m, i) for i in graph.input if (m := _PAST.match(i.name))]
    if not past:
        return []
    found: list[GraphMismatch] = []
    layers = len({int(m.group(1)) for m, _ in past})
    if layers != card.num_layers:
        found.append(GraphMismatch("num_layers", card.num_layers, layers))
    dims = _dims(past[0][1])
    if len(dims) == 4:
        pairs = (("kv_heads", card.kv_heads, dims[1]), ("head_dim", card.head_dim, dims[3]))
        for field, card_value, graph_value in pairs:
            if graph_value is not None and graph_value != card_value:
                found.append(GraphMismatch(field, card_value, graph_value))
    return found


class _Tables:
    """The embedding tables of a graph: initializers looked up by ``Gather`` (or ``GroupQueryAttention``'s
    rotary caches), told apart by what their indices are computed from."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self._graph = graph
        self._producers: dict[str, onnx.NodeProto] = {out: node for node in graph.node for out in node.output}
        self._initializers: dict[str, onnx.TensorProto] = {init.name: init for init in graph.initializer}

    def position_bound(self) -> tuple[int, str] | None:
        """(the fewest rows of a position table, ``the rows of <its name>``), or None: no table."""
        found: list[tuple[int, str]] = []
        for node in self._graph.node:
            table = None
            if node.op_type == "Gather" and len(node.input) == 2:
                table = self._table(node.input[0], _axis(node))  # first: the ancestry walk costs more
                table = table if table is not None and self._positional(node.input[1]) else None
            elif node.op_type == _GQA and len(node.input) > _COS_CACHE and node.input[_COS_CACHE]:
                table = self._table(node.input[_COS_CACHE], 0)
            if table is not None:
                found.append(table)
        if not found:
            return None
        rows, name = min(found)
        return rows, f"the rows of {name}"

    def _positional(self, indices: str) -> bool:
        leaves, ops = self._ancestry(indices)
        return bool(ops & _POSITION_OPS) or any(leaf.split(".")[-1] == "position_ids" for leaf in leaves)

    def _ancestry(self, name: str) -> tuple[set[str], set[str]]:
        """(the graph inputs and initializers ``name`` is computed from, the op types on the way)."""
        leaves: set[str] = set()
        ops: set[str] = set()
        seen = {name}
        todo = [name]
        while todo:
            node = self._producers.get(todo.pop())
            if node is None:
                continue
            ops.add(node.op_type)
            for src in node.input:
                if src and src not in seen:
                    seen.add(src)
                    todo.append(src)
        for src in seen:
            if src not in self._producers:
                leaves.add(src)
        return leaves, ops

    def _initializer(self, name: str) -> onnx.TensorProto | None:
        """The initializer ``name`` is, or is read from through casts, dequantization and slices."""
        for _ in range(_DATA_DEPTH):
            init = self._initializers.get(name)
            if init is not None:
                return init
            node = self._producers.get(name)
            if node is None or node.op_type not in _DATA_OPS or not node.input:
                return None
            name = node.input[0]
        return None

    def _dims(self, name: str) -> list[int] | None:
        init = self._initializer(name)
        return None if init is None else list(init.dims)

    def _table(self, name: str, axis: int) -> tuple[int, str] | None:
        """(its rows along ``axis``, the initializer's name) when ``name`` is a table of two dimensions or more."""
        init = self._initializer(name)
        if init is None or len(init.dims) < 2 or not -len(init.dims) <= axis < len(init.dims):
            return None
        return init.dims[axis], init.name


def _axis(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "axis"), 0)
