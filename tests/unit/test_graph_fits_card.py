"""Whether an ONNX graph is a model its card describes (:mod:`store.graph_fit`): pure, a table of graphs, then the
graphs the repo's own builders write (``max_positions`` against the position table)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from protocol.modelcard import ModelCard, load_card
from store.graph_fit import graph_mismatches
from tools.build_lm import build_causal_lm
from tools.fp16 import convert_to_fp16
from tools.inplace_kv import rewrite_inplace_kv

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


# -- positions and width, on the graphs the repo's own builders write (tests/conftest.py `model_dir`) ----------

def _built(model_dir: Path, name: str) -> tuple[onnx.ModelProto, ModelCard]:
    path = model_dir / name / f"{name}-1.0.0.onnx"
    return onnx.load(str(path), load_external_data=False), load_card(path)


@pytest.mark.parametrize(
    ("name", "card_change", "found"),
    [
        ("demo-lm", {}, []),
        ("demo-llama", {}, []),
        ("demo-encoder", {}, []),
        ("demo-lm", {"max_positions": 256}, []),  # fewer positions than the table holds: the card's choice
        ("demo-lm", {"max_positions": 100_000}, [("max_positions", 100_000, 512)]),
        ("demo-lm", {"max_positions": 50_000_000}, [("max_positions", 50_000_000, 512)]),
        ("demo-lm", {"max_positions": 513}, [("max_positions", 513, 512)]),
        ("demo-encoder", {"max_positions": 100_000}, [("max_positions", 100_000, 512)]),
        ("demo-llama", {"max_positions": 100_000}, []),  # rotary angles computed from position_ids: no table
        ("demo-lm", {"hidden_size": 128}, []),  # not compared: real models embed narrower (OPT-350m)
    ],
    ids=["lm", "llama", "encoder", "lm-fewer", "lm-positions", "lm-positions-huge", "lm-one-over",
         "encoder-positions", "llama-rotary", "lm-hidden-not-judged"],
)
def test_a_built_graph_bounds_positions_by_its_table(
    model_dir: Path, name: str, card_change: dict[str, Any], found: list[tuple[Any, ...]]
) -> None:
    proto, card = _built(model_dir, name)
    got = graph_mismatches(proto, card.model_copy(update=card_change))
    assert [(m.field, m.card_value, m.graph_value) for m in got] == found


def test_a_position_refusal_names_the_field_the_cards_value_and_the_tables_rows(model_dir: Path) -> None:
    proto, card = _built(model_dir, "demo-lm")
    (lie,) = graph_mismatches(proto, card.model_copy(update={"max_positions": 100_000}))
    assert lie.describe() == "max_positions 100000 (the graph's: at most 512, the rows of wpe.weight)"
    proto, card = _built(model_dir, "demo-encoder")
    (lie,) = graph_mismatches(proto, card.model_copy(update={"max_positions": 100_000}))
    assert lie.describe() == "max_positions 100000 (the graph's: at most 512, the rows of embeddings.position.weight)"


def test_a_smaller_table_bounds_a_card_that_keeps_the_default(tmp_path: Path) -> None:
    path = build_causal_lm(tmp_path, num_layers=1, max_positions=40)
    proto, card = onnx.load(str(path)), load_card(path)
    assert graph_mismatches(proto, card) == []
    assert [(m.field, m.graph_value) for m in graph_mismatches(proto, card.model_copy(update={"max_positions": 512}))] \
        == [("max_positions", 40)]


@pytest.mark.parametrize("variant", ["in-place", "fp16"])
def test_the_bound_survives_the_rewrites_a_version_is_pushed_after(
    model_dir: Path, tmp_path: Path, variant: str
) -> None:
    proto, card = _built(model_dir, "demo-lm")
    if variant == "in-place":
        proto = rewrite_inplace_kv(proto, num_heads=card.num_heads, kv_heads=card.kv_heads, head_dim=card.head_dim)
    else:  # float16: the table is converted where it lies, or read through a Cast
        convert_to_fp16(model_dir / "demo-lm" / "demo-lm-1.0.0.onnx", tmp_path / "fp16.onnx")
        proto = onnx.load(str(tmp_path / "fp16.onnx"))
    assert graph_mismatches(proto, card) == []
    got = graph_mismatches(proto, card.model_copy(update={"max_positions": 100_000}))
    assert [(m.field, m.graph_value) for m in got] == [("max_positions", 512)]


def _rotary_cache_graph(kind: str, rows: int) -> onnx.ModelProto:
    """A decoder whose positions index a rotary cache ``[rows, 8]``: HF's ``cos_cached[:S][position_ids]``
    (``gather``), or ``GroupQueryAttention``'s ``cos_cache`` input (``gqa``)."""
    cache = [numpy_helper.from_array(np.zeros((rows, 8), np.float32), n) for n in ("cos_cached", "sin_cached")]
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, ["b", "s"]) for n in ("input_ids", "position_ids")]
    if kind == "gather":
        ends = numpy_helper.from_array(np.array([64], np.int64), "ends")
        starts = numpy_helper.from_array(np.array([0], np.int64), "starts")
        cache += [starts, ends]
        nodes = [helper.make_node("Slice", ["cos_cached", "starts", "ends"], ["cos_s"]),
                 helper.make_node("Gather", ["cos_s", "position_ids"], ["cos"], axis=0),
                 helper.make_node("ReduceSum", ["cos"], ["logits"])]
    else:
        names = ["q", "k", "v", "pk", "pv", "seqlens", "total", "cos_cached", "sin_cached"]
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names[:7]]
        nodes = [helper.make_node("GroupQueryAttention", names, ["logits", "present.0.key", "present.0.value"],
                                  domain="com.microsoft", num_heads=1, kv_num_heads=1, do_rotary=1)]
    output = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", 512])
    return helper.make_model(helper.make_graph(nodes, "g", inputs, [output], cache))


@pytest.mark.parametrize("kind", ["gather", "gqa"])
def test_a_rotary_cache_bounds_positions_by_its_rows(kind: str) -> None:
    proto = _rotary_cache_graph(kind, rows=300)
    assert graph_mismatches(proto, CARD.model_copy(update={"max_positions": 300})) == []
    (lie,) = graph_mismatches(proto, CARD.model_copy(update={"max_positions": 4096}))
    assert lie.describe() == "max_positions 4096 (the graph's: at most 300, the rows of cos_cached)"
