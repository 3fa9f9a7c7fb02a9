"""A tiny graph builder over :mod:`onnx.helper`: nodes, initializers, inputs and outputs with unique names.

Every model of ``fleet build-model`` is assembled with :class:`GraphBuilder`::

    g = GraphBuilder("demo")
    x = g.input("x", onnx.TensorProto.FLOAT, ["batch_size", 8])
    w = g.weight("w", np.ones((8, 4), np.float32))
    g.op("MatMul", [x, w], outputs=["y"])
    g.output("y", onnx.TensorProto.FLOAT, ["batch_size", 4])
    model = g.build(metadata={"name": "demo"})

Weights (counted in :attr:`GraphBuilder.parameter_count`) and small constants (not counted) are both
stored as initializers. Models target ONNX opset :data:`OPSET` (LayerNormalization is available) and
IR version :data:`IR_VERSION`, so that ONNX Runtime releases from 1.14 on can load them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
from onnx import helper, numpy_helper

__all__ = ["FLOAT_MIN", "IR_VERSION", "OPSET", "Dim", "GraphBuilder"]

OPSET = 17
"""ONNX opset of every built model (17 is the first with LayerNormalization)."""

IR_VERSION = 8
"""ONNX IR version that goes with opset 17; newer IR versions lock out older ONNX Runtime releases."""

FLOAT_MIN = float(np.finfo(np.float32).min)
"""Additive attention bias of a masked key (as Hugging Face does; ``-inf`` would give NaN rows)."""

Dim = int | str
"""One dimension of a graph input or output: a fixed size or a symbolic name like ``"batch_size"``."""


class GraphBuilder:
    """Collects nodes and initializers and turns them into an :class:`onnx.ModelProto`.

    Names passed as ``hint`` are made unique by appending ``_1``, ``_2``, …; names given explicitly as
    graph inputs, outputs or ``outputs=`` of :meth:`op` are used verbatim (they are the model's API).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._nodes: list[onnx.NodeProto] = []
        self._initializers: list[onnx.TensorProto] = []
        self._inputs: list[onnx.ValueInfoProto] = []
        self._outputs: list[onnx.ValueInfoProto] = []
        self._used: set[str] = set()
        self._consts: dict[tuple[str, bytes, tuple[int, ...]], str] = {}
        self.parameter_count = 0
        """Number of weights (elements of initializers added with :meth:`weight`)."""

    # -- names -------------------------------------------------------------------------------------

    def unique(self, hint: str) -> str:
        """A name not used yet in this graph, ``hint`` itself if it is free."""
        name, n = hint, 0
        while name in self._used:
            n += 1
            name = f"{hint}_{n}"
        self._used.add(name)
        return name

    def _claim(self, name: str) -> str:
        if name in self._used:
            raise ValueError(f"name {name!r} is already used in graph {self.name!r}")
        self._used.add(name)
        return name

    # -- graph I/O ---------------------------------------------------------------------------------

    def input(self, name: str, elem_type: int, shape: Sequence[Dim]) -> str:
        """Declare a graph input of ``elem_type`` (a ``TensorProto`` type) and ``shape``; returns its name."""
        self._inputs.append(helper.make_tensor_value_info(self._claim(name), elem_type, list(shape)))
        return name

    def output(self, name: str, elem_type: int, shape: Sequence[Dim]) -> None:
        """Declare a graph output; ``name`` must be produced by a node (``op(..., outputs=[name])``)."""
        self._outputs.append(helper.make_tensor_value_info(name, elem_type, list(shape)))

    # -- initializers ------------------------------------------------------------------------------

    def weight(self, name: str, array: npt.NDArray[np.float32]) -> str:
        """Add a float32 weight initializer named ``name`` (verbatim) and count its elements."""
        tensor = numpy_helper.from_array(np.ascontiguousarray(array, dtype=np.float32), self._claim(name))
        self._initializers.append(tensor)
        self.parameter_count += int(array.size)
        return name

    def const(self, value: npt.ArrayLike, dtype: npt.DTypeLike, hint: str = "const") -> str:
        """A small constant initializer (shapes, axes, scalars); identical constants are shared."""
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.tobytes(), array.shape)
        if key not in self._consts:
            name = self.unique(hint)
            self._initializers.append(numpy_helper.from_array(array, name))
            self._consts[key] = name
        return self._consts[key]

    def i64(self, value: int | Sequence[int], hint: str = "i64") -> str:
        """An int64 constant: a scalar for an ``int``, a 1-D tensor for a sequence."""
        return self.const(value, np.int64, hint)

    def f32(self, value: float | Sequence[float], hint: str = "f32") -> str:
        """A float32 constant: a scalar for a ``float``, a 1-D tensor for a sequence."""
        return self.const(value, np.float32, hint)

    # -- nodes -------------------------------------------------------------------------------------

    def op(self, op_type: str, inputs: Sequence[str], *, hint: str | None = None,
           outputs: Sequence[str] | None = None, **attrs: Any) -> str:
        """Add one node with a single output and return that output's name.

        Args:
            op_type: ONNX operator, e.g. ``"MatMul"``.
            inputs: input value names (``""`` for an omitted optional input).
            hint: base for the generated output name (default: ``op_type`` in lower case).
            outputs: explicit output name(s) instead of a generated one.
            attrs: node attributes, passed to :func:`onnx.helper.make_node`.
        """
        return self.op_multi(op_type, inputs, 1, hint=hint, outputs=outputs, **attrs)[0]

    def op_multi(self, op_type: str, inputs: Sequence[str], n_out: int, *, hint: str | None = None,
                 outputs: Sequence[str] | None = None, **attrs: Any) -> list[str]:
        """Add one node with ``n_out`` outputs (e.g. ``Split``) and return their names."""
        base = hint or op_type.lower()
        if outputs is None:
            names = [self.unique(base if n_out == 1 else f"{base}_out{i}") for i in range(n_out)]
        else:
            names = [self._claim(o) for o in outputs]
        node = helper.make_node(op_type, list(inputs), names, name=self.unique(f"{base}_node"), **attrs)
        self._nodes.append(node)
        return names

    # -- model -------------------------------------------------------------------------------------

    def build(self, metadata: Mapping[str, object] | None = None, *, check: bool = True) -> onnx.ModelProto:
        """The finished model (opset :data:`OPSET`); ``metadata`` goes to ``metadata_props`` as strings.

        Raises:
            onnx.checker.ValidationError: ``check`` is set and the graph is not valid ONNX.
        """
        graph = helper.make_graph(self._nodes, self.name, self._inputs, self._outputs, self._initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                  ir_version=IR_VERSION, producer_name="onnx-fleet")
        for key, value in (metadata or {}).items():
            model.metadata_props.append(onnx.StringStringEntryProto(key=key, value=str(value)))
        if check:
            onnx.checker.check_model(model)
        return model

