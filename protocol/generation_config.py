"""A model folder's generation defaults and chat template, read from Hugging Face's files.

The folder that holds the model file (``models/demo-lm/`` for ``models/demo-lm/demo-lm-1.0.0.onnx``,
or an optimum export folder) may hold:

* ``generation_config.json`` — ``eos_token_id`` (an id or a list of ids), ``max_new_tokens``,
  ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``repetition_penalty``; other keys are ignored.
* ``chat_template.jinja`` — the chat template alone (what newer transformers releases save); it
  wins over the one in ``tokenizer_config.json``, as in transformers.
* ``tokenizer_config.json`` — ``chat_template``: a Jinja2 string, or a list of
  ``{"name": …, "template": …}`` of which the one named ``"default"`` is taken.

A missing file or key means "no default" (never an error). A file that is not valid JSON, or holds
a value of the wrong type or out of range, raises :class:`~protocol.errors.ModelLoadError` naming
the file (``field`` = the file's name, ``limit`` = its path).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from protocol.errors import ModelLoadError
from protocol.modelcard import ModelCard

__all__ = [
    "DEFAULTED_FIELDS",
    "GenerationDefaults",
    "load_chat_template",
    "load_generation_defaults",
    "resolve_generation",
]

GENERATION_CONFIG = "generation_config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"

_HF_SAMPLING = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}
"""transformers' defaults of the sampling knobs, in force when ``do_sample`` is true."""


@dataclass(frozen=True)
class GenerationDefaults:
    """What a model's ``generation_config.json`` (and card) say a generation should default to.

    ``eos_token_ids``: every id that ends a generation (the file's ``eos_token_id`` and the card's,
    together; empty = none known). The other fields are None where the model sets no default, so a
    request's own default applies. ``temperature`` 0.0 means greedy.
    """

    eos_token_ids: frozenset[int] = frozenset()
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None


_M = TypeVar("_M", bound=BaseModel)
_Id = Annotated[StrictInt, Field(ge=0)]
_Number = StrictInt | StrictFloat


class _GenerationConfigFile(BaseModel):
    """The keys of ``generation_config.json`` the fleet reads (checked; the rest ignored)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    eos_token_id: _Id | list[_Id] | None = None
    max_new_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    do_sample: StrictBool | None = None
    temperature: Annotated[_Number, Field(ge=0)] | None = None
    top_k: Annotated[StrictInt, Field(ge=0)] | None = None
    top_p: Annotated[_Number, Field(gt=0, le=1)] | None = None
    repetition_penalty: Annotated[_Number, Field(gt=0)] | None = None


class _NamedTemplate(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    name: StrictStr
    template: StrictStr


class _TokenizerConfigFile(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    chat_template: StrictStr | list[_NamedTemplate] | None = None


def _folder(model_path: Path) -> Path:
    """The folder of ``model_path`` (a model file), or ``model_path`` itself when it is a folder."""
    path = Path(model_path)
    return path if path.is_dir() else path.parent


def _read_text(path: Path) -> str | None:
    """The file's text, None when it does not exist.

    Raises:
        ModelLoadError: it exists but cannot be read as UTF-8 text.
    """
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}", path.name, str(path)) from exc


def _read_json(path: Path, schema: type[_M]) -> _M | None:
    """``path`` parsed and checked against ``schema``; None when the file does not exist.

    Raises:
        ModelLoadError: not valid JSON, not an object, or a key of the wrong type or out of range.
    """
    text = _read_text(path)
    if text is None:
        return None
    try:
        doc: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}", path.name, str(path)) from exc
    if not isinstance(doc, dict):
        raise ModelLoadError(f"{path} is not a JSON object", path.name, str(path))
    try:
        return schema.model_validate(doc)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ModelLoadError(f"{path} is invalid: {problems}", path.name, str(path)) from exc


def load_chat_template(model_path: Path) -> str | None:
    """The chat template (Jinja2 source) of the model at ``model_path`` (its file or its folder).

    ``chat_template.jinja`` if the folder has one, else ``tokenizer_config.json``'s ``chat_template``:
    the string, or from a list of named templates the one named ``"default"`` (None if none is).

    Returns:
        The template, or None when the folder has none.

    Raises:
        ModelLoadError: a file that cannot be read, is not valid JSON, or whose ``chat_template`` is
            neither a string nor a list of ``{"name", "template"}`` strings.
    """
    folder = _folder(model_path)
    template = _read_text(folder / CHAT_TEMPLATE_FILE)
    if template is not None:
        return template
    config = _read_json(folder / TOKENIZER_CONFIG, _TokenizerConfigFile)
    if config is None or config.chat_template is None:
        return None
    if isinstance(config.chat_template, str):
        return config.chat_template
    return next((t.template for t in config.chat_template if t.name == "default"), None)


def _sampling(config: _GenerationConfigFile) -> dict[str, Any]:
    """temperature/top_k/top_p defaults with transformers' meaning of ``do_sample``.

    Sampling knobs count only with ``do_sample: true`` (then an absent knob takes transformers'
    default: temperature 1.0, top_k 50, top_p 1.0; ``top_k: null`` = no cut, 0). Without it
    transformers decodes greedily whatever the knobs say, so a file that mentions ``do_sample`` or
    any knob gives temperature 0.0; a file that mentions none gives no default at all.
    """
    given = config.model_fields_set
    if config.do_sample:
        out = {key: getattr(config, key) if key in given else default for key, default in _HF_SAMPLING.items()}
        if "top_k" in given and config.top_k is None:
            out["top_k"] = 0
        return out
    mentioned = given & {"do_sample", *_HF_SAMPLING}
    return {"temperature": 0.0 if mentioned else None, "top_k": None, "top_p": None}


def load_generation_defaults(model_path: Path, card: ModelCard) -> GenerationDefaults:
    """The generation defaults of the model at ``model_path`` (its file or its folder).

    ``eos_token_ids`` is the union of ``generation_config.json``'s ``eos_token_id`` (an id or a
    list) and ``card.eos_token_id``; ``max_new_tokens`` and ``repetition_penalty`` are taken as
    written; temperature/top_k/top_p follow ``do_sample`` as transformers does (see :func:`_sampling`).
    Without the file: the card's EOS id alone, every other field None.

    Raises:
        ModelLoadError: the file cannot be read, is not valid JSON, or holds a known key of the wrong
            type or out of range (a negative id, ``top_p`` above 1, ``max_new_tokens`` 0, …).
    """
    eos = {card.eos_token_id} if card.eos_token_id is not None else set()
    config = _read_json(_folder(model_path) / GENERATION_CONFIG, _GenerationConfigFile)
    if config is None:
        return GenerationDefaults(eos_token_ids=frozenset(eos))
    file_eos = config.eos_token_id
    eos |= set(file_eos) if isinstance(file_eos, list) else ({file_eos} if file_eos is not None else set())
    sampling = _sampling(config)
    return GenerationDefaults(
        eos_token_ids=frozenset(eos),
        max_new_tokens=config.max_new_tokens,
        temperature=None if sampling["temperature"] is None else float(sampling["temperature"]),
        top_k=sampling["top_k"],
        top_p=None if sampling["top_p"] is None else float(sampling["top_p"]),
        repetition_penalty=None if config.repetition_penalty is None else float(config.repetition_penalty),
    )


DEFAULTED_FIELDS = ("max_new_tokens", "temperature", "top_k", "top_p", "repetition_penalty")
"""The generation fields a model's ``generation_config.json`` gives defaults for."""


def resolve_generation(
    given: Mapping[str, Any],
    defaults: GenerationDefaults,
    *,
    fallbacks: Mapping[str, Any] | None = None,
    max_new_tokens_cap: int | None = None,
) -> dict[str, Any]:
    """A generation's fields: what the caller ``given``, else the model's ``defaults``, else the face's
    ``fallbacks`` (OpenAI's temperature 1 and max_tokens 16), else nothing (the fleet's own defaults:
    greedy, 16 tokens). The one place every face (native API, FleetClient, CLI, OpenAI completions
    and chat) resolves a field the request left unset, as transformers' ``generate`` falls back on
    the model's generation config.

    A ``max_new_tokens`` that comes from a default (the model's or the face's, never the caller's) is
    cut to ``max_new_tokens_cap`` (the fleet's limit, and what fits beside the prompt; at least 1), so
    a default never makes a request fail. A caller's value is kept as given, to be checked against
    the limits.
    """
    fields = dict(given)
    model = {name: getattr(defaults, name) for name in DEFAULTED_FIELDS}
    for name, value in [*model.items(), *(fallbacks or {}).items()]:
        if value is None or name in fields:
            continue
        if name == "max_new_tokens" and max_new_tokens_cap is not None:
            value = max(1, min(int(value), max_new_tokens_cap))
        fields[name] = value
    return fields
