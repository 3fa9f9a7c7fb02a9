"""How an encoder turns token vectors into one sentence vector: what a sentence-transformers folder declares.

A sentence-transformers model folder says how its vectors are made in ``modules.json``: a list of
modules run in order, e.g.::

    [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
     {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
     {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]

and the Pooling module's ``<path>/config.json`` sets ``pooling_mode_cls_token``,
``pooling_mode_max_tokens``, ``pooling_mode_mean_tokens``, ``pooling_mode_mean_sqrt_len_tokens``,
``pooling_mode_weightedmean_tokens``, ``pooling_mode_lasttoken`` (several true: the vectors are
concatenated in that order, as sentence-transformers does) and ``include_prompt``.

:func:`load_pooling` looks for ``modules.json`` in the model file's folder, then in its parent when
that folder is ``onnx/`` (sentence-transformers' ONNX backend saves ``<model>/onnx/model.onnx``). Without
one the encoder is mean-pooled (the fleet's default). With one, the fleet serves exactly what it
declares, or refuses to load the model (:class:`~protocol.errors.ModelLoadError` naming the file and
what it cannot serve): a module other than Transformer, Pooling and Normalize (Dense, LayerNorm, …
change the vector and are not part of the ONNX graph), a Pooling module without a mode,
``include_prompt: false``, a pooling key the fleet does not know set to true, or a
``word_embedding_dimension`` that is not the model's hidden size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from protocol.errors import ModelLoadError

__all__ = ["MODULES_FILE", "POOLING_MODES", "Pooling", "PoolingMode", "load_pooling", "pooling_files"]

MODULES_FILE = "modules.json"

PoolingMode = Literal["cls", "max", "mean", "mean_sqrt_len", "weightedmean", "lasttoken"]

POOLING_MODES: dict[str, PoolingMode] = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
"""sentence-transformers' config keys → the fleet's mode names, in the order the vectors are concatenated."""

_NAMED_MODES = {
    "cls": "pooling_mode_cls_token", "max": "pooling_mode_max_tokens", "mean": "pooling_mode_mean_tokens",
    "mean_sqrt_len_tokens": "pooling_mode_mean_sqrt_len_tokens", "weightedmean": "pooling_mode_weightedmean_tokens",
    "lasttoken": "pooling_mode_lasttoken",
}  # fmt: skip
"""``pooling_mode`` strings sentence-transformers accepts → the config key each turns on."""

_SERVED_MODULES = {"Transformer", "Pooling", "Normalize"}
"""Module types (last part of ``type``) whose effect the fleet reproduces."""


@dataclass(frozen=True)
class Pooling:
    """How token vectors become the sentence vector.

    ``modes``: pooled vectors concatenated in this order (one mode: one vector of the hidden size).
    ``normalize``: the model ends with a Normalize module, so its vectors are always L2-normalised
    (a request's ``normalize`` can only add normalisation, never remove the model's).
    ``source``: the ``modules.json`` that declared it; None = no declaration (the fleet's mean pooling).
    """

    modes: tuple[PoolingMode, ...] = ("mean",)
    normalize: bool = False
    source: str | None = None


def _refuse(path: Path, what: str, field: str) -> ModelLoadError:
    return ModelLoadError(f"{path}: {what}", field, str(path))


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise _refuse(path, "file not found (modules.json names it)", path.name) from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _refuse(path, f"cannot be read as JSON: {exc}", path.name) from exc


def _modules_file(model_path: Path) -> Path | None:
    folder = model_path if model_path.is_dir() else model_path.parent
    candidates = [folder / MODULES_FILE]
    if folder.name == "onnx":  # sentence-transformers' ONNX backend: <model>/onnx/model.onnx
        candidates.append(folder.parent / MODULES_FILE)
    return next((c for c in candidates if c.is_file()), None)


def _pooling_modes(config_path: Path, hidden_size: int | None) -> tuple[PoolingMode, ...]:
    """The modes ``config_path`` (a Pooling module's config.json) turns on.

    Raises:
        ModelLoadError: see :func:`load_pooling`.
    """
    config = _read_json(config_path)
    if not isinstance(config, dict):
        raise _refuse(config_path, "is not a JSON object", config_path.name)
    named = config.get("pooling_mode")  # sentence-transformers' Pooling(pooling_mode="cls") spelling
    if named is not None:
        if named not in _NAMED_MODES:
            raise _refuse(config_path, f"pooling_mode {named!r} is not supported (supported: "
                          f"{', '.join(_NAMED_MODES)})", "pooling_mode")
        config = {**config, _NAMED_MODES[named]: True}
    unknown = sorted(k for k, v in config.items()
                     if k.startswith("pooling_mode_") and k not in POOLING_MODES and v)
    if unknown:
        raise _refuse(config_path, f"pooling mode {unknown[0]} is not supported (supported: "
                      f"{', '.join(POOLING_MODES)})", unknown[0])
    if config.get("include_prompt", True) is not True:
        raise _refuse(config_path, "include_prompt: false is not supported (the fleet pools every token of "
                      "the input; the prompt length is not known to it)", "include_prompt")
    dim = config.get("word_embedding_dimension")
    if hidden_size is not None and isinstance(dim, int) and dim != hidden_size:
        raise _refuse(config_path, f"word_embedding_dimension {dim} is not the model's hidden size {hidden_size}",
                      "word_embedding_dimension")
    modes = tuple(mode for key, mode in POOLING_MODES.items() if config.get(key) is True)
    if not modes:
        raise _refuse(config_path, f"no pooling mode is set to true (one of {', '.join(POOLING_MODES)})",
                      "pooling_mode")
    return modes


def load_pooling(model_path: Path, hidden_size: int | None = None) -> Pooling:
    """The pooling declared next to the encoder at ``model_path`` (its file or folder).

    ``hidden_size`` (the card's) is checked against the Pooling config's ``word_embedding_dimension``.

    Returns:
        ``Pooling()`` (mean, no forced normalisation) when no ``modules.json`` is found.

    Raises:
        ModelLoadError: ``modules.json`` or a Pooling config is unreadable, or declares what the fleet
            cannot serve (see the module docstring); the message names the file and the module or mode.
    """
    modules_path = _modules_file(Path(model_path))
    if modules_path is None:
        return Pooling()
    modules = _read_json(modules_path)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise _refuse(modules_path, "is not a list of modules", MODULES_FILE)
    modes: tuple[PoolingMode, ...] | None = None
    normalize = False
    for module in sorted(modules, key=lambda m: m.get("idx", 0) if isinstance(m.get("idx"), int) else 0):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind not in _SERVED_MODULES:
            raise _refuse(modules_path, f"module {module.get('type')!r} ({module.get('path')!r}) is not supported: "
                          "the fleet serves Transformer, Pooling and Normalize modules only", "type")
        if kind == "Pooling":
            if modes is not None:
                raise _refuse(modules_path, "declares two Pooling modules", "type")
            modes = _pooling_modes(modules_path.parent / str(module.get("path", "")) / "config.json", hidden_size)
        elif kind == "Normalize":
            normalize = True
    if modes is None:
        raise _refuse(modules_path, "has no Pooling module: the fleet cannot tell how to make one vector "
                      "per input", "type")
    return Pooling(modes=modes, normalize=normalize, source=str(modules_path))


def pooling_files(folder: Path) -> list[str]:
    """The files of ``folder`` that declare its pooling, relative to it: ``modules.json`` and each module's
    ``<path>/config.json`` that exists (a model store publishes them with the model, so a fetched
    version is pooled as the published one). Empty when ``folder`` has no readable ``modules.json``;
    :func:`load_pooling` reports what is wrong with it."""
    try:
        modules = json.loads((folder / MODULES_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return []
    found = [MODULES_FILE]
    for module in modules if isinstance(modules, list) else []:
        sub = str(module.get("path") or "") if isinstance(module, dict) else ""
        config = f"{sub}/config.json"
        if sub and ".." not in sub.split("/") and not sub.startswith("/") and (folder / config).is_file():
            found.append(config)
    return found
