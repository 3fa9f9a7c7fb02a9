"""Whether an ONNX graph is a model its card describes (:mod:`store.graph_fit`): pure, a table of graphs."""

from __future__ import annotations

from typing import Any

import onnx
import pytest
from onnx import TensorProto, helper

from protocol.modelcard import ModelCard
from store.graph_fit import graph_mismatches

CARD = ModelCard(name="m", version="1", kind="causal_lm", vocab_size=512, max_positions=64, num_layers=2,
                 num_heads=4, head_dim=16, hidden_size=64, tokenizer="byte")


def _graph(outputs: dict[str, list[Any]], pasts: int = 0, kv: tuple[Any, Any] = (4, 16)) -> onnx.ModelProto:
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"])]
    for i in range(pasts):
        for part in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{part}", TensorProto.FLOAT,
                                                        ["b", kv[0], "p", kv[1]]))
    outs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, dims) for name, dims in outputs.items()]
    nodes = [helper.make_node("Identity", ["input_ids"], [name]) for name in outputs]
    return helper.make_model(helper.make_graph(nodes, "g", inputs, outs))


@pytest.mark.parametrize(
    ("proto", "card_change", "found"),
    [
        (_graph({"logits": ["b", "s", 512]}, pasts=2), {}, []),
        (_graph({"logits": ["b", "s", "vocab"]}, pasts=2, kv=("h", "d")), {}, []),  # symbolic: not judged
        (_graph({"y": [8]}), {}, []),  # a graph the fleet does not drive by name: not judged
        (_graph({"logits": ["b", "s", 512]}), {}, []),  # no KV inputs: the layout is not judged
        (onnx.ModelProto(), {}, [("graph", "a model", "0 nodes, 0 outputs")]),
        (_graph({"logits": ["b", "s", 512]}, pasts=2), {"vocab_size": 1024}, [("vocab_size", 1024, 512)]),
        (_graph({"last_hidden_state": ["b", "s", 64]}), {},
         [("kind", "causal_lm", "encoder (outputs last_hidden_state, not logits)")]),
        (_graph({"logits": ["b", "s", 512]}), {"kind": "encoder"},
         [("kind", "encoder", "causal_lm (outputs logits, not last_hidden_state)")]),
        (_graph({"last_hidden_state": ["b", "s", 32]}), {"kind": "encoder"}, [("hidden_size", 64, 32)]),
        (_graph({"logits": ["b", "s", 512]}, pasts=3, kv=(2, 16)), {},
         [("num_layers", 2, 3), ("kv_heads", 4, 2)]),
    ],
    ids=["fits", "symbolic", "unnamed", "no-kv", "empty", "vocab", "encoder-graph", "lm-graph", "hidden",
         "kv-layout"],
)
def test_graph_mismatches(proto: onnx.ModelProto, card_change: dict[str, Any], found: list[tuple[Any, ...]]) -> None:
    card = CARD.model_copy(update=card_change)
    assert [(m.field, m.card_value, m.graph_value) for m in graph_mismatches(proto, card)] == found
