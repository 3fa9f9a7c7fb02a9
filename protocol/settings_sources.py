"""What :func:`protocol.settings.load_settings` feeds the settings and how it words a refusal: the YAML
file read and its relative paths resolved, models named only in the environment, nested dicts merged, and a
:class:`pydantic.ValidationError` turned into the dotted setting, its ``FLEET_*`` variable and the rule."""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from protocol.errors import ConfigError
from protocol.settings_env import setting_type

__all__ = [
    "deep_merge",
    "describe",
    "first_loc",
    "name_env_only_models",
    "norm_name",
    "read_yaml",
    "resolve_model_paths",
]


def norm_name(name: str) -> str:
    """``name`` as model names are compared: case, surrounding blanks and ``-``/``_`` ignored."""
    return name.strip().lower().replace("_", "-")


def read_yaml(path: Path) -> Any:
    """The parsed YAML file; a syntax error or an unreadable file becomes one ConfigError naming the file.

    Raises:
        ConfigError: the file is not valid YAML (file, line, column and the parser's reason) or cannot be read.
    """
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        reason = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"config file {where}: invalid YAML: {reason}; fix the file or point FLEET_CONFIG "
                          "at another one", "FLEET_CONFIG", "valid YAML") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc}", "FLEET_CONFIG", "a readable file") from exc


def name_env_only_models(data: dict[str, Any]) -> None:
    """Give a model named only in the environment its hyphenated name.

    Environment variable names cannot hold ``-``, so ``FLEET_MODELS__BENCH_LM__PATH`` names model
    ``bench-lm`` (queue ``fleet.bench-lm``), the spelling every command and the docs use, unless the
    YAML file spells that model otherwise (then the YAML spelling is kept).
    """
    if not isinstance(data.get("models"), dict):
        return
    known = {norm_name(str(k)) for k in data["models"]}
    prefix = "FLEET_MODELS__"
    for var in os.environ:
        if not var.upper().startswith(prefix) or "__" not in var[len(prefix):]:
            continue
        name = var[len(prefix):].split("__", 1)[0].lower().replace("_", "-")
        if name and norm_name(name) not in known:
            data["models"][name] = {}
            known.add(norm_name(name))


def resolve_model_paths(data: dict[str, Any], base: Path) -> None:
    """Relative model paths (and TensorRT cache folders) in a YAML file are relative to its folder."""
    for model in (data.get("models") or {}).values():
        if not isinstance(model, dict):
            continue
        if model.get("path") is not None and not Path(str(model["path"])).is_absolute():
            model["path"] = str((base / str(model["path"])).resolve())
        engine = model.get("engine")
        if (
            isinstance(engine, dict)
            and "cache_dir" in engine
            and not Path(str(engine["cache_dir"])).is_absolute()
        ):
            engine["cache_dir"] = str((base / str(engine["cache_dir"])).resolve())


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra`` merged in, nested dicts merged key by key (neither input changes)."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def first_loc(exc: ValidationError) -> str:
    """The dotted path of the first setting ``exc`` refuses (``settings`` when it names none)."""
    errs = exc.errors()
    return ".".join(str(p) for p in errs[0]["loc"]) if errs else "settings"


PATTERN_RULES = {
    r"^(redis|rediss|unix|sentinel)://": "must start with redis://, rediss://, unix:// or sentinel:// "
    "(e.g. redis://127.0.0.1:6379/0)",
    r"^https?://": "must start with http:// or https:// (e.g. http://127.0.0.1:8333)",
}
"""The settings' URL patterns in words (pydantic says ``String should match pattern '^(redis|…)://'``)."""


def describe(exc: ValidationError) -> str:
    """Every refusal in ``exc``, ``; ``-joined: ``invalid setting <dotted path> (<FLEET_* variable>): <rule>``,
    ``unknown setting <dotted path> (…): did you mean <the closest known one>?``, or ``invalid settings:
    <rule>`` for a rule across several settings (its message names them). A refused value is never shown
    (a URL may hold a password)."""
    lines = []
    for err in exc.errors():
        msg = str(err["msg"]).removeprefix("Value error, ")
        if not err["loc"]:  # a rule across several settings: its message names them
            lines.append(f"invalid settings: {msg}")
            continue
        loc = ".".join(str(p) for p in err["loc"])
        env = "FLEET_" + "__".join(str(p).upper().replace("-", "_") for p in err["loc"])
        if err["type"] == "extra_forbidden":
            lines.append(f"unknown setting {loc} ({env}): {_known_instead([str(p) for p in err['loc']])}")
            continue
        if err["type"] == "string_pattern_mismatch":
            msg = PATTERN_RULES.get(str((err.get("ctx") or {}).get("pattern")), msg)
        lines.append(f"invalid setting {loc} ({env}): {msg}")
    return "; ".join(lines)


def _known_instead(loc: list[str]) -> str:
    """For the unknown setting at ``loc``: the closest known name of its section, or the section's names."""
    section = setting_type(loc[:-1])
    names = sorted(section.model_fields) if isinstance(section, type) and issubclass(section, BaseModel) else []
    where = ".".join(loc[:-1]) or "the top level"
    if not names:
        return "no such setting"
    close = difflib.get_close_matches(loc[-1], names, n=1, cutoff=0.6)
    if close:
        return f"did you mean {'.'.join([*loc[:-1], close[0]])}?"
    return f"{where} has no such setting; its settings: {', '.join(names)}"
