"""The plan of the same-weights rows (:mod:`bench.same_weights`): the rows, the Llama sizes and the workload sizes.

Apart from the measurement so that the page's renderer (:mod:`bench.same_weights_md`) reads the rows without
the measuring code; ``tools.build_llama`` gives the sizes' weight counts and Hugging Face configs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tools.build_llama import ROPE_THETA, llama_parameter_count, swiglu_width
from tools.onnx_layers import RMS_EPSILON

__all__ = ["QUICK", "ROWS", "TEXT_ONLY", "LlamaSize", "SameWeightsPlan"]

ROWS = ("fleet", "OpenAI SDK, streaming", "worker's loop, in process", "bare continuous", "bare one at a time",
        "og.Engine")
"""The rows, in the first round's order (each later round starts one row further on)."""
TEXT_ONLY = frozenset({"OpenAI SDK, streaming"})
"""Rows whose replies carry text, not token ids: their tokens are counted (``usage``), not compared."""


@dataclass(frozen=True)
class LlamaSize:
    """One model of the page (``tools.build_llama.build_llama``'s sizes)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    max_positions: int = 256
    targets: tuple[tuple[str, float], ...] = ()
    """(ratio, target) pairs the page checks: a ratio key of ``ratios`` (the fleet over that row, or
    ``"<row> / fleet"``), or ``"TTFT p99"`` (fleet / bare continuous, at most the target)."""

    @property
    def parameters(self) -> int:
        return llama_parameter_count(num_layers=self.num_layers, hidden_size=self.hidden_size,
                                     num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                     vocab_size=self.vocab_size)  # fmt: skip

    def hf_config(self) -> dict[str, Any]:
        """The Hugging Face ``LlamaConfig`` of these weights (what the builder reads)."""
        return {"vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
                "intermediate_size": swiglu_width(self.hidden_size), "num_hidden_layers": self.num_layers,
                "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
                "max_position_embeddings": self.max_positions, "rms_norm_eps": RMS_EPSILON,
                "rope_theta": ROPE_THETA, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
                "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}  # fmt: skip


@dataclass(frozen=True)
class SameWeightsPlan:
    """Sizes of the same-weights rows (the defaults: the outside harness's workload)."""

    sizes: tuple[LlamaSize, ...] = (
        LlamaSize("sw-llama-31m", num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=4, vocab_size=8192,
                  targets=(("bare continuous", 1.0), ("bare one at a time", 3.0), ("og.Engine", 2.0),
                           ("OpenAI SDK, streaming / fleet", 0.95), ("TTFT p99", 2.0))),
        LlamaSize("sw-llama-7m", num_layers=4, hidden_size=256, num_heads=8, num_kv_heads=4, vocab_size=8192,
                  targets=(("bare continuous", 0.9),)),
    )
    requests: int = 16
    prompt_tokens: tuple[int, int] = (10, 64)
    new_tokens: tuple[int, int] = (19, 63)
    max_batch_size: int = 16
    rounds: int = 6
    seed: int = 7


QUICK = SameWeightsPlan(
    sizes=(LlamaSize("sw-llama-tiny", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, vocab_size=300),),
    requests=4, prompt_tokens=(4, 12), new_tokens=(3, 8), max_batch_size=4, rounds=1)  # fmt: skip
