"""A generation's unset fields filled from the model's ``generation_config.json``, on the producer side.

:meth:`producer.client.FleetClient.build_request` calls :func:`generation_fields` for every
``generate`` request, whichever face built it (native ``POST /v1/requests``, ``FleetClient.submit``,
``fleet submit``, OpenAI completions and chat), so a field the caller left unset takes the model's
default everywhere, as transformers' ``generate`` does. The rule itself is
:func:`protocol.generation_config.resolve_generation`; this module finds what it needs (the fields
the caller set, the model's defaults, the room beside the prompt).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from protocol.generation_config import GenerationDefaults, load_generation_defaults, resolve_generation
from protocol.messages import GenerationParams
from protocol.modelcard import ModelCard
from protocol.settings import ModelSettings

__all__ = ["generation_fields", "model_generation_defaults"]


@lru_cache(maxsize=64)
def model_generation_defaults(model_path: Path, card: ModelCard | None) -> GenerationDefaults:
    """The defaults of the model file at ``model_path``; none when its folder is not on this machine.

    Read once per model file and process (a ``generation_config.json`` changed later needs a restart).

    Raises:
        ModelLoadError: the file is there but invalid (see :func:`load_generation_defaults`).
    """
    if card is None or not Path(model_path).exists():
        return GenerationDefaults()
    return load_generation_defaults(model_path, card)


def given_fields(generation: GenerationParams | Mapping[str, Any] | None) -> dict[str, Any]:
    """The fields the caller set: a GenerationParams' ``model_fields_set``, a mapping's keys (None values
    count as unset)."""
    if generation is None:
        return {}
    if isinstance(generation, GenerationParams):
        return generation.model_dump(include=generation.model_fields_set)
    return {k: v for k, v in generation.items() if v is not None}


def generation_fields(
    generation: GenerationParams | Mapping[str, Any] | None,
    *,
    model: ModelSettings,
    card: ModelCard | None,
    prompt_tokens: int,
    fallbacks: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The generation's fields with the unset ones resolved (see the module docstring).

    A defaulted ``max_new_tokens`` is cut to ``model.limits.max_new_tokens``, to what fits beside the
    prompt of ``prompt_tokens`` tokens in ``card.max_positions`` and in the worker's KV budget
    ``model.batching.max_kv_tokens``: a default never makes a request fail.

    Raises:
        ModelLoadError: the model's ``generation_config.json`` is invalid.
    """
    prompt = min(prompt_tokens, model.limits.max_input_tokens)
    cap = min(model.limits.max_new_tokens, model.batching.max_kv_tokens - prompt)
    if card is not None:
        cap = min(cap, card.max_positions - prompt)
    return resolve_generation(
        given_fields(generation),
        model_generation_defaults(Path(model.path), card),
        fallbacks=fallbacks,
        max_new_tokens_cap=max(1, cap),
    )
