"""The element type of a causal LM's KV cache, read from its graph's ``past_key_values.*`` inputs.

A float32 export and a float16 one (what GPU deployments serve: optimum's ``--dtype fp16``, or
``fleet quantize --target cuda``) take the same inputs with different element types, and ONNX Runtime refuses
a past of the other type ("Unexpected input data type"). Every array the worker makes for the cache
(the empty past of a prefill, a re-laid-out batch, the in-place slots, the prefix cache's copies) takes
the type this module reads from the session, never a fixed one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from protocol.errors import ModelLoadError

__all__ = ["KV_DTYPES", "graph_kv_dtype", "kv_dtype", "session_kv_dtype"]

KV_DTYPES: dict[str, type[np.floating[Any]]] = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
"""ONNX Runtime's type string of a past input → the numpy type of the cache's arrays."""
_ONNX_TYPE_NAMES = {1: "tensor(float)", 10: "tensor(float16)", 11: "tensor(double)", 16: "tensor(bfloat16)"}
"""``onnx.TensorProto`` element types → ONNX Runtime's type strings (the others are named by number)."""
PAST = "past_key_values."


class _Arg:
    """A graph input as :func:`kv_dtype` reads it (``onnx`` inputs have no ORT type string)."""

    def __init__(self, name: str, onnx_type: str) -> None:
        self.name, self.type = name, onnx_type


def kv_dtype(past_inputs: Sequence[Any]) -> type[np.floating[Any]]:
    """The numpy element type of the cache from the session's ``past_key_values.*`` inputs (``NodeArg``s:
    ``.name``, ``.type``); float32 when there are none.

    Raises:
        ModelLoadError: a past input of another type (bfloat16, double: numpy or the fleet's kernels
            have none), or past inputs of mixed types; the message names the input and its type.
    """
    found: dict[str, str] = {arg.name: arg.type for arg in past_inputs}
    for name, onnx_type in found.items():
        if onnx_type not in KV_DTYPES:
            raise ModelLoadError(
                f"{name} is {onnx_type}; the KV cache can be float32 or float16 ({', '.join(KV_DTYPES)})",
                name, onnx_type)
    types = sorted(set(found.values()))
    if len(types) > 1:
        raise ModelLoadError(f"past_key_values inputs mix {' and '.join(types)}: one KV cache holds one type",
                             "past_key_values.*", types)
    return KV_DTYPES[types[0]] if types else np.float32


def session_kv_dtype(session: Any) -> type[np.floating[Any]]:
    """:func:`kv_dtype` of an ``onnxruntime.InferenceSession``'s past inputs."""
    return kv_dtype([arg for arg in session.get_inputs() if arg.name.startswith(PAST)])


def graph_kv_dtype(model: Any) -> type[np.floating[Any]]:
    """:func:`kv_dtype` of an ``onnx.ModelProto``'s past inputs (before any session opens it)."""
    args = []
    for graph_input in model.graph.input:
        if graph_input.name.startswith(PAST):
            elem = graph_input.type.tensor_type.elem_type
            args.append(_Arg(graph_input.name, _ONNX_TYPE_NAMES.get(elem, f"tensor(type {elem})")))
    return kv_dtype(args)
