"""What to say about a ``FLEET_*`` environment variable pydantic-settings could not read.

pydantic-settings reads a setting that holds a list, a mapping or a section from its variable as JSON, and
when that fails its ``SettingsError`` names only the top-level field (``error parsing value for field "api"
from source "EnvSettingsSource"``). :func:`settings_env_problem` finds the variable, says why and shows how
that setting is written; :func:`protocol.settings.load_settings` raises it as a ``ConfigError``, so the
``fleet`` CLI, ``FleetClient.from_settings``, the gateway and a bare ``celery -A workers.app worker`` all
say the same line.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any, get_args, get_origin

from pydantic import BaseModel
from pydantic_settings import SettingsError

__all__ = ["setting_type", "settings_env_problem"]


def settings_env_problem(exc: SettingsError, environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """One line for a ``FLEET_*`` variable pydantic-settings could not read (its ``SettingsError`` names only the
    top-level field): the variable, why, and how that setting is written; and the variable's name (the
    ``FLEET_<FIELD>...`` prefix when no variable of that field is found to be the culprit).

    A setting holding a list, a mapping or a section is read from its variable as JSON, so
    ``FLEET_API__API_KEYS=change-me`` or ``['change-me']`` (Python's quotes) are refused: the line names the
    variable and shows the form (``FLEET_API__API_KEYS='["a", "b"]'``), never the value (it may be a
    secret). ``environ`` defaults to ``os.environ``.
    """
    found = re.search(r'field "([^"]+)"', str(exc))
    field = found.group(1).lower() if found else ""
    env = os.environ if environ is None else environ
    for var, value in sorted(env.items()):
        parts = var.upper().removeprefix("FLEET_").split("__") if var.upper().startswith("FLEET_") else []
        if not parts or parts[0].lower() != field:
            continue
        shape = _json_shape(setting_type(parts), var)
        if shape is None:
            continue
        try:
            json.loads(value)
        except ValueError as why:  # the decoder's message holds a position, not the value
            return f"environment variable {var} is not valid JSON ({why}); {shape}", var
    return (f"a FLEET_{field.upper()}... environment variable could not be read ({exc}); a setting that holds a "
            "list or a section is written as JSON, e.g. FLEET_API__API_KEYS='[\"a\", \"b\"]'", f"FLEET_{field.upper()}")


def setting_type(parts: list[str]) -> Any:
    """The type of the setting ``FLEET_<parts joined by __>`` names (a model's name is one part), or None."""
    from protocol.settings import FleetSettings  # the settings module raises through this one

    annotation: Any = FleetSettings
    for part in parts:
        annotation = _without_none(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            fields = {name.lower(): info for name, info in annotation.model_fields.items()}
            if part.lower() not in fields:
                return None
            annotation = fields[part.lower()].annotation
        elif get_origin(annotation) is dict:
            annotation = get_args(annotation)[1]  # the part is a key (a model's name)
        else:
            return None
    return _without_none(annotation)


def _without_none(annotation: Any) -> Any:
    """``X`` of ``X | None`` (the annotation itself otherwise)."""
    args = [a for a in get_args(annotation) if a is not type(None)]
    return args[0] if len(args) == 1 and type(None) in get_args(annotation) else annotation


def _json_shape(annotation: Any, var: str) -> str | None:
    """How to write the variable ``var`` of a setting read as JSON (None for a scalar: pydantic reads those as
    they are). No value is shown: the variable may hold API keys or passwords."""
    origin = get_origin(annotation) or annotation
    if origin in (list, tuple, set, frozenset):
        return f"this setting is a list: write it as JSON, each string in double quotes, e.g. {var}='[\"a\", \"b\"]'"
    if origin is dict or (isinstance(origin, type) and issubclass(origin, BaseModel)):
        return (f"this setting is a section: write it as a JSON object, e.g. {var}='{{\"field\": 1}}', or set its "
                f"fields one variable each ({var}__FIELD=value)")
    return None
