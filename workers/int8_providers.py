"""Whether an INT8 graph gets INT8 kernels from the active execution providers: one warning line when not.

ONNX Runtime places each node on the first provider of the chain that has a kernel for it, and says
so only in a VERBOSE log line, which a worker's log level hides. Two INT8 cases lose their point on
a GPU that way:

* dynamic INT8 (``fleet quantize --mode dynamic``): ``DynamicQuantizeLinear`` and ``MatMulInteger``
  with ``uint8`` activations have no CUDA kernels and TensorRT takes neither, so they run on the CPU,
  with device↔host copies around each of them at every batch;
* static QDQ INT8 on the CUDA EP without TensorRT: the CUDA EP has no INT8 MatMul for the
  ``QuantizeLinear → DequantizeLinear → MatMul`` pattern; it dequantizes and multiplies in FP32,
  with the (de)quantization as extra work. Only TensorRT (``trt_int8_enable``) builds INT8 layers
  from it.

:func:`int8_provider_warning` is the pure decision (op types and active providers in, the line out);
:func:`int8_placement_warning` reads the op types of a model file, only when a GPU provider is active.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import onnx

__all__ = ["DYNAMIC_INT8_OPS", "QDQ_OPS", "graph_op_types", "int8_placement_warning", "int8_provider_warning"]

DYNAMIC_INT8_OPS = frozenset(
    {"DynamicQuantizeLinear", "MatMulInteger", "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "ConvInteger"}
)
"""Ops of dynamic INT8 graphs (as ``quantize_dynamic`` writes them, or ONNX Runtime's fusions of them)."""

QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear"})
"""Ops of static QDQ INT8 graphs."""

_CUDA = "CUDAExecutionProvider"
_TRT = "TensorrtExecutionProvider"


def int8_provider_warning(op_types: Iterable[str], providers: Sequence[str]) -> str | None:
    """One line naming why an INT8 graph gets no INT8 kernels on ``providers`` and the fix; None when
    it does, or when no GPU provider is active (on the CPU both INT8 forms have INT8 kernels).

    ``providers`` is the session's active list (``session.get_providers()``).
    """
    ops = set(op_types)
    dynamic = sorted(ops & DYNAMIC_INT8_OPS)
    if dynamic and (_CUDA in providers or _TRT in providers):
        return (
            f"dynamic INT8 ops {'/'.join(dynamic)} have no CUDA kernels (nor TensorRT layers): they run on "
            "CPU with copies per batch; quantize static QDQ for TensorRT (`fleet quantize --target tensorrt`) "
            "or serve FP32/FP16 on CUDA"
        )
    if ops & QDQ_OPS and _CUDA in providers and _TRT not in providers:
        return (
            "static QDQ INT8 gets no INT8 kernels on the CUDA EP without TensorRT: it dequantizes and runs "
            "FP32 MatMuls, with QuantizeLinear/DequantizeLinear as extra work; serve it with "
            "TensorrtExecutionProvider (trt_int8_enable) or serve FP32/FP16 on CUDA"
        )
    return None


def graph_op_types(model_path: Path) -> set[str]:
    """The op types of the main graph of ``model_path`` (external weights are not read)."""
    model = onnx.load(str(model_path), load_external_data=False)
    return {node.op_type for node in model.graph.node}


def int8_placement_warning(model_path: Path, providers: Sequence[str]) -> str | None:
    """:func:`int8_provider_warning` for a model file; the graph is read only when a GPU provider is
    active (a CPU worker pays nothing)."""
    if _CUDA not in providers and _TRT not in providers:
        return None
    return int8_provider_warning(graph_op_types(model_path), providers)
