"""The model card: the JSON file that sits next to every ONNX model the fleet serves.

For ``models/demo-lm/demo-lm-1.0.0.onnx`` the card is ``models/demo-lm/demo-lm-1.0.0.json``.
Producers read it to tokenize text and validate ids before queueing; workers read it to know
the model's kind, vocabulary and KV-cache geometry. A model exported by optimum has no card:
:func:`load_card` then falls back to a ``config.json`` in the same folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from protocol.errors import ModelLoadError

__all__ = ["ModelCard", "ModelKind", "card_path_for", "load_card"]

ModelKind = Literal["causal_lm", "encoder"]


class ModelCard(BaseModel):
    """What a producer and a worker need to know about one model file."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    name: str = Field(description="Model name, e.g. 'demo-lm'.")
    version: str = Field(description="Semantic version of this file, e.g. '1.0.0' or '1.0.0-int8'.")
    kind: ModelKind
    vocab_size: int = Field(gt=0)
    max_positions: int = Field(gt=0, description="Largest past+sequence length the model accepts (tokens).")
    num_layers: int = Field(ge=0)
    num_heads: int = Field(gt=0)
    num_kv_heads: int | None = Field(
        default=None, gt=0, description="Heads of past_key_values (grouped-query attention); None = num_heads."
    )
    head_dim: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    pad_token_id: int = 0
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    tokenizer: str = Field(
        default="byte",
        description="'byte' for the built-in byte-level tokenizer, else a tokenizer.json path "
        "relative to the card's folder.",
    )
    parameters: int = Field(default=0, ge=0, description="Number of weights (for reports).")
    seed: int | None = None
    quantization: str | None = Field(default=None, description="None for FP32, else e.g. 'int8-dynamic'.")

    @property
    def kv_heads(self) -> int:
        """Heads of each ``past_key_values.{i}.key/.value`` tensor."""
        return self.num_kv_heads or self.num_heads


def card_path_for(model_path: Path) -> Path:
    """Path of the card that belongs to ``model_path`` (same stem, ``.json``)."""
    return model_path.with_suffix(".json")


def load_card(model_path: Path) -> ModelCard:
    """Load the card of ``model_path``.

    Raises:
        ModelLoadError: when neither a card nor an optimum ``config.json`` can be read.
    """
    card_file = card_path_for(model_path)
    if card_file.exists():
        try:
            return ModelCard.model_validate_json(card_file.read_text())
        except ValidationError as exc:
            raise ModelLoadError(f"model card {card_file} is invalid: {exc}", "card", str(card_file)) from exc
    config_file = model_path.parent / "config.json"
    if config_file.exists():
        return _card_from_hf_config(model_path, json.loads(config_file.read_text()))
    raise ModelLoadError(
        f"no model card {card_file.name} or config.json next to {model_path}", "card", str(card_file)
    )


def _card_from_hf_config(model_path: Path, cfg: dict[str, object]) -> ModelCard:
    """Build a card from a Hugging Face ``config.json`` (optimum export folder)."""

    def get(*keys: str, default: object = None) -> object:
        for key in keys:
            if key in cfg:
                return cfg[key]
        return default

    hidden = int(str(get("hidden_size", "n_embd", "d_model", default=0)))
    heads = int(str(get("num_attention_heads", "n_head", default=1)))
    archs = get("architectures", default=[])
    is_lm = any(
        "CausalLM" in str(a) or "LMHead" in str(a) for a in (archs if isinstance(archs, list) else [])
    )
    tok = "tokenizer.json" if (model_path.parent / "tokenizer.json").exists() else "byte"
    return ModelCard(
        name=model_path.stem,
        version=str(get("_fleet_version", default="0.0.0")),
        kind="causal_lm" if is_lm else "encoder",
        vocab_size=int(str(get("vocab_size", default=1))),
        max_positions=int(str(get("max_position_embeddings", "n_positions", default=512))),
        num_layers=int(str(get("num_hidden_layers", "n_layer", default=0))),
        num_heads=heads,
        head_dim=max(1, hidden // max(1, heads)),
        hidden_size=max(1, hidden),
        pad_token_id=int(str(get("pad_token_id", default=0) or 0)),
        tokenizer=tok,
    )
