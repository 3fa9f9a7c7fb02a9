"""Copies into and out of one slot of an in-place KV cache held as ONNX Runtime values on a device.

A slot's first ``n`` columns are not one contiguous run of memory: each KV head's ``n x head_dim``
block starts ``capacity x head_dim`` elements after the previous head's. Host buffers (numpy) copy them
with a slice assignment; device buffers (CUDA memory, :class:`~workers.generation.slots.SlotCache` with
a ``device``) have no such view from Python, so the copies are two tiny ONNX Runtime graphs run with I/O
binding on the cache's device, one call per copy whatever the layers:

- *write*: each past's ``[kv_heads, n, head_dim]`` host array goes in, ``Split`` along the heads gives
  ``kv_heads`` outputs ``[1, n, head_dim]``, each bound at its head's address in the slot;
- *read*: ``kv_heads`` inputs ``[1, n, head_dim]`` bound at those addresses, ``Concat`` gives the past's
  ``[kv_heads, n, head_dim]``, bound on the host.

The same graphs run on a CPU device (the tests run them there against numpy slots).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import onnxruntime as ort
from onnx import TensorProto, helper

__all__ = ["SlotCopier"]

_ONNX_TYPES = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16}
_PROVIDERS = {"cpu": ["CPUExecutionProvider"], "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"]}


def _head(i: int, h: int) -> str:
    return f"head_{i}_{h}"


def _graph(names: Sequence[str], heads: int, dim: int, dtype: np.dtype[Any], *, write: bool) -> bytes:
    """The write (Split) or read (Concat) graph over every past of ``names`` (by index)."""
    elem = _ONNX_TYPES[dtype]
    whole = [helper.make_tensor_value_info(f"kv_{i}", elem, [heads, "n", dim]) for i in range(len(names))]
    parts = [helper.make_tensor_value_info(_head(i, h), elem, [1, "n", dim])
             for i in range(len(names)) for h in range(heads)]
    nodes = []
    for i in range(len(names)):
        outs = [_head(i, h) for h in range(heads)]
        if write:
            nodes.append(helper.make_node("Split", [f"kv_{i}"], outs, axis=0, num_outputs=heads)
                         if heads > 1 else helper.make_node("Identity", [f"kv_{i}"], outs))
        else:
            nodes.append(helper.make_node("Concat", outs, [f"kv_{i}"], axis=0))
    graph = helper.make_graph(nodes, "slot_write" if write else "slot_read",
                              whole if write else parts, parts if write else whole)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return bytes(model.SerializeToString())


class SlotCopier:
    """The write and read graphs of one cache layout, on ``device`` (``("cpu" | "cuda", device_id)``)."""

    def __init__(self, names: Sequence[str], *, kv_heads: int, head_dim: int, dtype: np.dtype[Any],
                 device: tuple[str, int]) -> None:
        self.names = list(names)
        self.heads, self.dim, self.dtype = kv_heads, head_dim, np.dtype(dtype)
        self.device = device
        kind, index = device
        providers: list[Any] = list(_PROVIDERS[kind])
        if kind == "cuda":
            providers[0] = ("CUDAExecutionProvider", {"device_id": str(index)})
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        self._write = ort.InferenceSession(_graph(self.names, kv_heads, head_dim, self.dtype, write=True), opts,
                                           providers=providers)
        self._read = ort.InferenceSession(_graph(self.names, kv_heads, head_dim, self.dtype, write=False), opts,
                                          providers=providers)

    def write(self, address: Callable[[str, int], int], kv: Mapping[str, npt.NDArray[Any]]) -> None:
        """Copy each ``kv[name]`` (``[kv_heads, n, head_dim]``, host) to ``address(name, head)`` onwards (device)."""
        binding = self._write.io_binding()
        kind, index = self.device
        for i, name in enumerate(self.names):
            array = np.ascontiguousarray(kv[name], dtype=self.dtype)
            binding.bind_cpu_input(f"kv_{i}", array)
            for h in range(self.heads):
                binding.bind_output(_head(i, h), kind, index, self.dtype, [1, array.shape[1], self.dim],
                                    address(name, h))
        self._write.run_with_iobinding(binding)
        binding.synchronize_outputs()

    def read(self, address: Callable[[str, int], int], tokens: int) -> dict[str, npt.NDArray[Any]]:
        """The ``tokens`` first columns from ``address(name, head)`` onwards: name → ``[kv_heads, tokens, head_dim]``
        (host copies)."""
        binding = self._read.io_binding()
        kind, index = self.device
        for i, name in enumerate(self.names):
            for h in range(self.heads):
                binding.bind_input(_head(i, h), kind, index, self.dtype, [1, tokens, self.dim], address(name, h))
            binding.bind_output(f"kv_{i}", "cpu", 0)
        self._read.run_with_iobinding(binding)
        return {name: np.asarray(out) for name, out in zip(self.names, binding.copy_outputs_to_cpu(), strict=True)}
