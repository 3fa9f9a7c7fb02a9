"""Convert a model to float16 for the CUDA provider: weights, activations and the KV cache in half precision.

``fleet quantize MODEL.onnx --target cuda`` (or ``--mode fp16``) runs this and then the same accuracy report
and gate as INT8 (:mod:`tools.quantize`). What changes and what does not:

- every float32 initializer and intermediate tensor becomes float16 (ONNX Runtime's own converter,
  ``onnxruntime.transformers.float16``; ops it keeps in float32 get ``Cast`` nodes around them);
- ``past_key_values.*`` inputs and ``present.*`` outputs become float16: the cache is half the bytes, and
  an in-place cache's ``GroupQueryAttention`` needs it (its CUDA kernel takes float16 only);
- every other graph input and output keeps its type (``input_ids`` int64, ``logits`` and
  ``last_hidden_state`` float32), so producers, clients and the worker's post-processing see what they did.

Causal LMs and encoders alike (an encoder's report compares its mean-pooled vectors).

The worker reads the cache's type from the graph (:mod:`workers.kv_dtype`), so a float16 export from
elsewhere (optimum's ``--dtype fp16``) is served the same way.
"""

from __future__ import annotations

from pathlib import Path

import onnx

__all__ = ["KV_PREFIXES", "convert_to_fp16", "kept_io"]

KV_PREFIXES = ("past_key_values.", "present.")
"""Graph inputs and outputs that become float16 (the KV cache); every other keeps its type."""


def kept_io(model: onnx.ModelProto) -> list[str]:
    """Names of the graph inputs and outputs that keep their type: all but the KV cache's."""
    graph = model.graph
    initializers = {init.name for init in graph.initializer}
    names = [i.name for i in graph.input if i.name not in initializers] + [o.name for o in graph.output]
    return [name for name in names if not name.startswith(KV_PREFIXES)]


def convert_to_fp16(src: Path, dst: Path) -> dict[str, object]:
    """Write the float16 graph of ``src`` (float32) to ``dst``; returns what was converted, for the report.

    Raises:
        ValueError: ``src`` holds no float32 initializer (already float16, or INT8 only: nothing to convert).
    """
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = onnx.load(str(src))
    floats = sum(1 for init in model.graph.initializer if init.data_type == onnx.TensorProto.FLOAT)
    if floats == 0:
        raise ValueError(f"{src} holds no float32 weights: it is float16 or quantized already")
    kept = kept_io(model)
    converted = convert_float_to_float16(model, keep_io_types=kept)
    onnx.save(converted, str(dst))
    kv = [i.name for i in converted.graph.input if i.name.startswith(KV_PREFIXES)]
    return {"converter": "onnxruntime.transformers.float16", "float32_initializers": floats,
            "kept_io_types": kept, "float16_kv_inputs": len(kv)}
