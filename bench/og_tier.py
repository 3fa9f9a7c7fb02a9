"""onnxruntime-genai's side of the same-weights rows; runs in the ``genai`` tier's venv, never in the fleet's.

Self-contained (onnx, numpy, torch, transformers, onnxruntime-genai; nothing of the fleet), two commands:

``export LLAMA.onnx HF_CONFIG.json OUT_DIR MAX_BATCH``
    Write the fleet's Llama (``tools/build_llama.py``: Hugging Face's weight names, matrices stored
    ``[in, out]``) as a Hugging Face checkpoint in ``OUT_DIR/hf`` (``config.json``, ``model.safetensors``,
    a word-level tokenizer over the ids: the builder saves one, the rows never use it), then run
    onnxruntime-genai's model builder on it (FP32, CPU) into ``OUT_DIR/og``, whose ``og.Engine`` then
    batches up to ``MAX_BATCH`` requests (``engine.static_batching.max_batch_size``: on CPU the engine
    batches statically; its paged, dynamic batching is CUDA-only).

``run OG_DIR WORK.json OUT.json``
    Serve ``WORK.json``'s requests (``[[prompt ids], max_new_tokens]`` each, all arriving at once) with
    ``og.Engine`` (greedy, forced lengths: min = max generated tokens) and write per request its tokens,
    first-token and finish times (s from the first ``begin_turn``) and the whole span.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

LINEAR_SUFFIXES = ("_proj.weight", "lm_head.weight")
"""Weights stored ``[in, out]`` in the fleet's graph and ``[out, in]`` (``nn.Linear``) in a checkpoint."""


def export(onnx_path: Path, hf_config: Path, out_dir: Path, max_batch: int) -> None:
    import onnx
    import torch
    import transformers
    from onnx import numpy_helper
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = json.loads(hf_config.read_text())
    model = onnx.load(str(onnx_path))
    names = {f"model.layers.{i}.{part}" for i in range(config["num_hidden_layers"]) for part in (
        "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
        "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")}  # fmt: skip
    names |= {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    tensors = {}
    for init in model.graph.initializer:
        if init.name in names:
            array = numpy_helper.to_array(init, base_dir=str(onnx_path.parent))
            if init.name.endswith(LINEAR_SUFFIXES):
                array = array.T
            tensors[init.name] = torch.from_numpy(np.array(array, dtype=np.float32, order="C"))
    missing = names - tensors.keys()
    if missing:
        sys.exit(f"{onnx_path}: not the fleet's Llama, missing {sorted(missing)[:4]}")
    hf = out_dir / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    transformers.LlamaConfig(architectures=["LlamaForCausalLM"], **config).save_pretrained(hf)
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
    vocab = {f"<{i}>": i for i in range(config["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<1>", eos_token="<2>",
                                         pad_token="<0>", unk_token="<0>").save_pretrained(hf)  # fmt: skip
    builder = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out_dir / "og"),
               "-p", "fp32", "-e", "cpu"]  # fmt: skip
    built = subprocess.run(builder, capture_output=True, text=True)
    if built.returncode != 0:
        sys.exit(f"onnxruntime-genai's builder failed (exit {built.returncode}):\n{built.stderr[-4000:]}")
    genai_config = out_dir / "og" / "genai_config.json"
    settings = json.loads(genai_config.read_text())
    settings.setdefault("engine", {})["static_batching"] = {"max_batch_size": max_batch}
    genai_config.write_text(json.dumps(settings, indent=4))


def run(og_dir: Path, work_path: Path, out_path: Path) -> None:
    import onnxruntime  # before onnxruntime_genai: the ORT library it binds to
    import onnxruntime_genai as og

    work = json.loads(work_path.read_text())
    engine = og.Engine(og.Model(str(og_dir)))
    caps = engine.get_capabilities()
    started = time.perf_counter()
    requests: list[object] = []
    turns: list[dict[str, Any]] = []
    for prompt, new_tokens in work:
        request = engine.create_request()
        options = og.TurnOptions(request)
        options.set_do_sample(False)
        options.set_max_generated_tokens(int(new_tokens))
        options.set_min_generated_tokens(int(new_tokens))
        request.begin_turn(np.asarray(prompt, dtype=np.int32), options)
        requests.append(request)
        turns.append({"tokens": [], "first_s": None, "done_s": None, "finish": None})
    buffer = engine.create_event_buffer(max(64, 4 * len(work)))
    while engine.has_pending_requests():
        for event in engine.run(buffer):
            turn = turns[_index_of(requests, event.request)]
            now = time.perf_counter() - started
            flags = int(event.flags.value)
            if flags & int(og.EngineEventFlags.FAILED.value):
                sys.exit(f"og.Engine failed a request: error {event.error_code}")
            if flags & (int(og.EngineEventFlags.TOKEN.value) | int(og.EngineEventFlags.TURN_FINISHED.value)):
                turn["tokens"].append(int(event.token))
                turn["first_s"] = now if turn["first_s"] is None else turn["first_s"]
            if flags & int(og.EngineEventFlags.TURN_FINISHED.value):
                turn["done_s"], turn["finish"] = now, event.finish_reason.name
    span = time.perf_counter() - started
    out_path.write_text(json.dumps({
        "span_s": span, "requests": turns,
        "capabilities": {"configured_max_batch_size": caps.configured_max_batch_size,
                         "max_scheduled_tokens": caps.max_scheduled_tokens},
        "versions": {"onnxruntime_genai": og.__version__, "onnxruntime": onnxruntime.__version__},
    }))  # fmt: skip


def _index_of(requests: list[object], request: object) -> int:
    """Which of ``requests`` an event's request is (the binding may hand back a new wrapper of it)."""
    for n, candidate in enumerate(requests):
        if candidate is request or candidate == request:
            return n
    raise LookupError("an event for a request this run did not create")


if __name__ == "__main__":
    command, *args = sys.argv[1:] or [""]
    if command == "export" and len(args) == 4:
        export(Path(args[0]), Path(args[1]), Path(args[2]), int(args[3]))
    elif command == "run" and len(args) == 3:
        run(Path(args[0]), Path(args[1]), Path(args[2]))
    else:
        sys.exit("usage: og_tier.py export LLAMA.onnx HF_CONFIG.json OUT_DIR MAX_BATCH | run OG_DIR WORK.json OUT.json")
