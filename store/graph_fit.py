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
  ``[batch, kv_heads, past, head_dim]`` with the card's ``kv_heads`` and ``head_dim``.
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


@dataclass(frozen=True)
class GraphMismatch:
    """One thing the graph says otherwise than the card (``field`` is the card's field)."""

    field: str
    card_value: int | str
    graph_value: int | str

    def describe(self) -> str:
        """``vocab_size 1024 (the graph's: 512)``."""
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
    if card.kind == "causal_lm":
        found += _kv_mismatches(graph, card)
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
