"""Build, export and generate the references for the optimum tier (runs INSIDE var/optimum-venv).

For each of a tiny random GPT-2 and a tiny random Llama with grouped-query attention:

1. build ``*ForCausalLM`` from a config (seeded; 2 layers, hidden 64, vocab 1000, 256 positions);
2. run transformers' greedy ``generate()`` on each prompt ALONE (batch 1, no padding) without an
   EOS, then pick an EOS id that the greedy output of the first prompt reaches part-way (so at least
   one request ends with finish_reason 'stop'), write it into the config and ``save_pretrained``;
3. export the saved folder with optimum to ONNX ``text-generation-with-past``;
4. generate the references again, now with that EOS: ``generate()`` stops at it and keeps it.

Usage: ``python export_models.py OUT_DIR``. Writes ``OUT_DIR/<model>/model.onnx`` (+ config.json,
generation_config.json) and ``OUT_DIR/references.json``::

    {"versions": {...}, "models": {"hf-gpt2": {"onnx": "hf-gpt2/model.onnx", "eos_token_id": 17,
     "requests": [{"prompt": [...], "max_new_tokens": 12, "token_ids": [...], "finish_reason": "stop",
     "min_margin": 0.03}, ...]}}}

``min_margin`` is the smallest gap between the best and the second-best logit over the request's
greedy steps: a gap near float rounding would make "exactly the same tokens" a coin toss, so the
script refuses (exit 3) to write references whose margin is below ``MIN_MARGIN``.
"""

from __future__ import annotations

import json
import random
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from optimum.exporters.onnx import main_export
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedModel

SEED = 1234
VOCAB = 1000
MAX_POSITIONS = 256
N_PROMPTS = 12
MIN_MARGIN = 1e-3
"""Logit gap (best - second best) below which a greedy step is too close to call across runtimes."""
INIT_RANGE = 0.2
"""Weight std: larger than HF's 0.02 so that random logits are spread out (clear greedy winners)."""


def gpt2() -> PreTrainedModel:
    cfg = GPT2Config(
        vocab_size=VOCAB, n_positions=MAX_POSITIONS, n_embd=64, n_layer=2, n_head=4,
        bos_token_id=0, eos_token_id=None, pad_token_id=None, initializer_range=INIT_RANGE,
    )
    return GPT2LMHeadModel(cfg)


def llama() -> PreTrainedModel:
    cfg = LlamaConfig(
        vocab_size=VOCAB, max_position_embeddings=MAX_POSITIONS, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, bos_token_id=0,
        eos_token_id=None, pad_token_id=None, initializer_range=INIT_RANGE, tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg)


BUILDERS = {"hf-gpt2": gpt2, "hf-llama": llama}


def make_requests(rng: random.Random) -> list[dict[str, Any]]:
    """Mixed prompt lengths (1-60 tokens) and max_new_tokens (1-40), edges included."""
    lengths = [1, 60, 2, 37, 5, 13, 48, 1, 24, 9, 31, 3][:N_PROMPTS]
    news = [40, 1, 17, 40, 2, 33, 8, 25, 39, 12, 5, 28][:N_PROMPTS]
    return [
        {"prompt": [rng.randrange(1, VOCAB) for _ in range(n)], "max_new_tokens": m}
        for n, m in zip(lengths, news, strict=True)
    ]


@torch.no_grad()
def greedy_alone(model: PreTrainedModel, prompt: list[int], max_new: int, eos: int | None) -> dict[str, Any]:
    """transformers' own greedy generate() for one prompt, batch 1, no padding."""
    ids = torch.tensor([prompt], dtype=torch.long)
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, min_new_tokens=0,
        do_sample=False, num_beams=1, eos_token_id=eos, pad_token_id=eos if eos is not None else 0,
        use_cache=True, output_scores=True, return_dict_in_generate=True,
    )
    new = out.sequences[0, len(prompt):].tolist()  # generate() returns prompt + new tokens
    margins = []
    for step in out.scores:
        top2 = torch.topk(step[0].float(), 2).values
        margins.append(float(top2[0] - top2[1]))
    reason = "stop" if eos is not None and new and new[-1] == eos else "length"
    return {"token_ids": new, "finish_reason": reason, "min_margin": min(margins)}


def choose_eos(tokens: list[int]) -> int | None:
    """The first token, from the 4th on, that the sequence had not produced before."""
    for i in range(3, len(tokens)):
        if tokens[i] not in tokens[:i]:
            return tokens[i]
    return None


def build_one(name: str, out: Path, requests: list[dict[str, Any]]) -> dict[str, Any]:
    torch.manual_seed(SEED)
    model = BUILDERS[name]().eval()
    free = [greedy_alone(model, r["prompt"], r["max_new_tokens"], None) for r in requests]
    eos = choose_eos(free[0]["token_ids"])
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos
    hf_dir = out / f"{name}-hf"
    model.save_pretrained(hf_dir)
    onnx_dir = out / name
    main_export(str(hf_dir), onnx_dir, task="text-generation-with-past", do_validation=False)
    refs = [{**r, **greedy_alone(model, r["prompt"], r["max_new_tokens"], eos)} for r in requests]
    low = [(i, r["min_margin"]) for i, r in enumerate(refs) if r["min_margin"] < MIN_MARGIN]
    if low:
        print(f"{name}: greedy steps too close to call (request, margin): {low}", file=sys.stderr)
        sys.exit(3)
    return {"onnx": f"{name}/model.onnx", "eos_token_id": eos, "requests": refs}


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    requests = make_requests(random.Random(SEED))
    models = {name: build_one(name, out, requests) for name in BUILDERS}
    versions = {p: version(p) for p in ("torch", "transformers", "optimum", "optimum-onnx", "onnx", "onnxruntime")}
    (out / "references.json").write_text(json.dumps({"versions": versions, "models": models}, indent=1))


if __name__ == "__main__":
    main()
