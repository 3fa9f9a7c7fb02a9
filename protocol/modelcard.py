"""The model card: the JSON file that sits next to every ONNX model the fleet serves.

For ``models/demo-lm/demo-lm-1.0.0.onnx`` the card is ``models/demo-lm/demo-lm-1.0.0.json``.
Producers read it to tokenize text and validate ids before queueing; workers read it to know
the model's kind, vocabulary and KV-cache geometry. A model exported by optimum has no card:
:func:`load_card` then falls back to a ``config.json`` in the same folder: kind, vocabulary and
KV geometry are read from it, the tokenizer is the folder's ``tokenizer.json`` or ``"none"``, and the
version is ``models.<name>.version`` from the fleet's settings (which overrides any card's), else
``config.json``'s ``_fleet_version`` or ``version``, else ``0.0.0``.
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
        min_length=1,
        description="'byte' for the built-in byte-level tokenizer, 'none' for a model without a "
        "tokenizer (text is refused: send token ids), else a tokenizer.json path relative to the "
        "card's folder.",
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
    """Load the card of ``model_path``: the ``.json`` next to it, else the folder's ``config.json``.

    Raises:
        ModelLoadError: ``model_path`` is not there (and no card names it); neither a card nor a
            ``config.json`` is there; or the one found is not
            valid JSON or does not describe a usable model (one line: the file, the offending key and why).
    """
    card_file = card_path_for(model_path)
    if card_file.exists():
        try:
            return ModelCard.model_validate_json(card_file.read_text())
        except ValidationError as exc:
            raise ModelLoadError(f"model card {card_file} is invalid: {_first_problem(exc)}", "card",
                                 str(card_file)) from exc
    config_file = model_path.parent / "config.json"
    if config_file.exists():
        try:
            cfg = json.loads(config_file.read_text())
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{config_file} is not valid JSON: {exc}", "card", str(config_file)) from exc
        if not isinstance(cfg, dict):
            raise ModelLoadError(f"{config_file} is not a JSON object", "card", str(config_file))
        return _card_from_hf_config(model_path, cfg)
    if not model_path.exists():  # the path is what is wrong, not a card beside a model that is there
        raise ModelLoadError(f"{model_path}: no such model file (check the path, or build the models: "
                             "`fleet build-model`)", "model", str(model_path))  # fmt: skip
    if model_path.is_dir():  # a folder named where its .onnx file belongs
        onnx = sorted(p.name for p in model_path.glob("*.onnx"))
        inside = f" (it holds {', '.join(onnx[:3])})" if onnx else " (it holds no .onnx file)"
        raise ModelLoadError(f"{model_path} is a folder{inside}: point the model's path at the .onnx file inside",
                             "model", str(model_path))  # fmt: skip
    raise ModelLoadError(
        f"no model card {card_file.name} or config.json next to {model_path}", "card", str(card_file)
    )


def _first_problem(exc: ValidationError) -> str:
    """``key: why`` of the first thing pydantic refused (``why`` alone for JSON that does not parse), and how
    many more there are."""
    errors = exc.errors()
    key = ".".join(str(part) for part in errors[0]["loc"])
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{key}: {errors[0]['msg']}{more}" if key else f"{errors[0]['msg']}{more}"


_DECODER_TYPES = frozenset({
    "bloom", "codegen", "falcon", "gemma", "gemma2", "gpt2", "gpt_neo", "gpt_neox", "gptj", "llama",
    "mistral", "mixtral", "mpt", "olmo", "opt", "phi", "phi3", "qwen2", "qwen3", "stablelm", "starcoder2",
})  # fmt: skip
"""``model_type`` values of decoder-only (causal LM) families."""

_ENCODER_TYPES = frozenset({
    "albert", "bert", "camembert", "deberta", "deberta-v2", "distilbert", "electra", "modernbert", "mpnet",
    "roberta", "xlm-roberta",
})  # fmt: skip
"""``model_type`` values of encoder (BERT-like) families."""


def _card_from_hf_config(model_path: Path, cfg: dict[str, object]) -> ModelCard:
    """Build a card from a Hugging Face ``config.json`` (optimum export folder) for ``model_path``.

    Read: ``vocab_size`` (required); the kind (see below); ``num_hidden_layers``/``n_layer``;
    ``num_attention_heads``/``n_head``; ``num_key_value_heads``/``num_kv_heads``/``n_head_kv``
    (``multi_query: true`` = 1) → ``num_kv_heads``; ``head_dim`` (default hidden size / heads);
    ``hidden_size``/``n_embd``/``d_model``; ``max_position_embeddings``/``n_positions`` (default
    512); ``pad_token_id`` (default 0), ``bos_token_id``, ``eos_token_id`` (a list gives its first id).

    Kind: ``architectures`` naming a ``…CausalLM`` or ``…LMHead…`` class → ``causal_lm``, any other
    class → ``encoder``. Without ``architectures``: ``is_decoder: true`` or a decoder ``model_type``
    (gpt2, llama, mistral, qwen2, phi, gpt_neox, opt, bloom, falcon, …) → ``causal_lm``; an encoder
    ``model_type`` (bert, roberta, distilbert, xlm-roberta, mpnet, electra, deberta, …) → ``encoder``.

    Tokenizer: ``tokenizer.json`` when the folder has one, else ``'none'`` (text is refused; the
    byte tokenizer is never guessed — write a card with ``"tokenizer": "byte"`` to use it).

    Version: a model without a card has no version of its own. Set ``models.<name>.version`` in
    the fleet's settings (``FLEET_MODELS__<NAME>__VERSION``), which overrides any card's version;
    or add ``"_fleet_version": "1.2.0"`` (or ``"version"``) to ``config.json``; or write a card
    ``<model>.json`` next to the model. Otherwise the version is ``0.0.0``.

    Raises:
        ModelLoadError: no ``vocab_size``; no ``architectures`` and the kind cannot be told from
            ``is_decoder``/``model_type`` (field ``architectures``); a value of the wrong type
            or out of range (names the key).
    """
    vocab_size = _config_int(cfg, "vocab_size")
    if vocab_size is None:
        raise ModelLoadError(f"config.json next to {model_path} has no vocab_size", "vocab_size", None)
    hidden = _config_int_or(cfg, 0, "hidden_size", "n_embd", "d_model")
    heads = max(1, _config_int_or(cfg, 1, "num_attention_heads", "n_head"))
    kv_heads = _config_int(cfg, "num_key_value_heads", "num_kv_heads", "n_head_kv")
    if kv_heads is None and cfg.get("multi_query") is True:
        kv_heads = 1
    version = next((cfg[k] for k in ("_fleet_version", "version") if cfg.get(k) is not None), "0.0.0")
    try:
        return ModelCard(
            name=model_path.stem,
            version=str(version),
            kind=_kind_from_hf_config(cfg),
            vocab_size=vocab_size,
            max_positions=_config_int_or(cfg, 512, "max_position_embeddings", "n_positions"),
            num_layers=_config_int_or(cfg, 0, "num_hidden_layers", "n_layer"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=_config_int_or(cfg, max(1, hidden // heads), "head_dim"),
            hidden_size=max(1, hidden),
            pad_token_id=_config_int_or(cfg, 0, "pad_token_id"),
            bos_token_id=_config_int(cfg, "bos_token_id"),
            eos_token_id=_config_int(cfg, "eos_token_id"),
            tokenizer="tokenizer.json" if (model_path.parent / "tokenizer.json").exists() else "none",
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ModelLoadError(
            f"config.json next to {model_path} does not describe a usable model: {exc}",
            ".".join(str(part) for part in first["loc"]),
            None,
        ) from exc


def _config_int(cfg: dict[str, object], *keys: str) -> int | None:
    """The first of ``keys`` that ``cfg`` sets (not null) as an integer; a list gives its first item
    (several eos ids: the card holds one); None when none is set.

    Raises:
        ModelLoadError: the value is not an integer (names the key).
    """
    key = next((k for k in keys if cfg.get(k) is not None), None)
    if key is None:
        return None
    value = cfg[key]
    if isinstance(value, list):
        value = value[0] if value else None
        if value is None:
            return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelLoadError(f"config.json {key} = {cfg[key]!r} is not an integer", key, "integer")
    return value


def _config_int_or(cfg: dict[str, object], default: int, *keys: str) -> int:
    """:func:`_config_int`, with ``default`` when none of ``keys`` is set."""
    value = _config_int(cfg, *keys)
    return default if value is None else value


def _kind_from_hf_config(cfg: dict[str, object]) -> ModelKind:
    """``causal_lm`` or ``encoder`` from ``architectures``, else ``is_decoder``/``model_type``.

    Raises:
        ModelLoadError: (field ``architectures``) none of them tells.
    """
    archs = cfg.get("architectures")
    if isinstance(archs, list) and archs:
        is_lm = any("CausalLM" in str(a) or "LMHead" in str(a) for a in archs)
        return "causal_lm" if is_lm else "encoder"
    model_type = str(cfg.get("model_type") or "")
    if cfg.get("is_decoder") is True or model_type in _DECODER_TYPES:
        return "causal_lm"
    if model_type in _ENCODER_TYPES:
        return "encoder"
    raise ModelLoadError(
        f"config.json has no architectures and model_type {model_type or None!r} does not tell whether the "
        'model is a causal LM or an encoder: add "architectures" (e.g. ["LlamaForCausalLM"] or ["BertModel"]) '
        "or write a model card next to the model",
        "architectures",
        None,
    )
