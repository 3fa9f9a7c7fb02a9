"""Real ONNX models that load, pass the worker's start-up runs, and fail in ONNX Runtime on real requests.

A model that fails for every input never serves: the worker's warm-up and its placement run (token id 3,
:meth:`workers.engine.Engine.warm_up`, :meth:`workers.generation.loop.GenerationLoop.warm_up`) fail it at
start (exit 3). What readiness must see is an engine that starts and then fails every request. So
:func:`guard_token_ids` routes every ``input_ids`` of a built model through a lookup in a table of
``first_bad_id`` rows (``ids + Gather(zeros[first_bad_id], ids)``: the same ids while each is below
``first_bad_id``); for any id at or above it ``Gather`` fails at run time ("indices element out of data
bounds"). ONNX shape inference cannot see it (the shapes are those of a valid graph), so the session opens.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

__all__ = ["FIRST_BAD_ID", "guard_token_ids"]

FIRST_BAD_ID = 4
"""Token ids below this run (the start-up runs use 3); any id at or above it fails in the engine."""


def guard_token_ids(model_path: Path, out_dir: Path, first_bad_id: int = FIRST_BAD_ID) -> Path:
    """Copy ``model_path``'s folder (card, generation assets) into ``out_dir`` with the guarded graph.

    Args:
        model_path: a built model (``<dir>/<name>/<name>-<version>.onnx``, its card next to it).
        out_dir: root of the copy; the model keeps its name, version and card.
        first_bad_id: the table's rows: ids from it up fail at run time.

    Returns:
        The copy's ``.onnx`` path.
    """
    folder = out_dir / model_path.parent.name
    shutil.copytree(model_path.parent, folder)
    model = onnx.load(str(model_path))
    graph = model.graph
    table, looked_up, guarded = "guard.table", "guard.looked_up", "guard.input_ids"
    for node in graph.node:  # every consumer of the input reads the guarded ids
        node.input[:] = [guarded if name == "input_ids" else name for name in node.input]
    graph.initializer.append(numpy_helper.from_array(np.zeros(first_bad_id, np.int64), table))
    guard = [helper.make_node("Gather", [table, "input_ids"], [looked_up], name="guard.gather", axis=0),
             helper.make_node("Add", ["input_ids", looked_up], [guarded], name="guard.add")]
    nodes = guard + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.checker.check_model(model)
    path = folder / model_path.name
    onnx.save(model, str(path))
    return path
